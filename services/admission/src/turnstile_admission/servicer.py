"""The AdmissionService gRPC handlers: thin, validate → domain → contract."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio

from turnstile_admission import validation
from turnstile_admission.admitter import Admitter
from turnstile_admission.responses import AdmitResponses
from turnstile_clientkeys import BoundedKey
from turnstile_clientkeys.contract import KEY_KINDS
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_platform.authz.ownership import current_scope

Context = grpc.aio.ServicerContext[Any, Any]


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    def __init__(self, admitter: Admitter) -> None:
        self._admitter = admitter
        self._responses = AdmitResponses()

    async def Admit(  # noqa: N802 - the gRPC method name
        self, request: admission_pb2.AdmitRequest, context: Context
    ) -> admission_pb2.AdmitResponse:
        admit = validation.admit_request(request)
        if admit.wait_s > 0:
            # The wait ends before the caller's deadline, with time left to claim.
            remaining = context.time_remaining()
            if remaining is not None:
                margin = self._admitter.settings.queue.claim_margin_s
                admit = admit._replace(wait_s=max(0.0, min(admit.wait_s, remaining - margin)))
        decision = await self._admitter.admit(admit)
        return self._responses.response(decision)

    async def CommitHold(  # noqa: N802
        self, request: admission_pb2.CommitHoldRequest, context: Context
    ) -> admission_pb2.CommitHoldResponse:
        hold_id = validation.hold_id(request.hold_id)
        committed = await self._admitter.commit(hold_id)
        return admission_pb2.CommitHoldResponse(committed=committed)

    async def CancelHold(  # noqa: N802
        self, request: admission_pb2.CancelHoldRequest, context: Context
    ) -> admission_pb2.CancelHoldResponse:
        hold_id = validation.hold_id(request.hold_id)
        answer = await self._admitter.cancel(hold_id)
        return admission_pb2.CancelHoldResponse(
            cancelled=answer.cancelled,
            client_tokens_returned=answer.client_tokens,
            cluster_tokens_returned=answer.cluster_tokens,
        )

    async def ReleaseSandbox(  # noqa: N802
        self, request: admission_pb2.ReleaseSandboxRequest, context: Context
    ) -> admission_pb2.ReleaseSandboxResponse:
        sandbox_id = validation.sandbox_id(request.sandbox_id)
        released = await self._admitter.release(sandbox_id)
        return admission_pb2.ReleaseSandboxResponse(released=released)

    async def GetUsage(  # noqa: N802
        self, request: admission_pb2.GetUsageRequest, context: Context
    ) -> admission_pb2.GetUsageResponse:
        usage = await self._admitter.usage(validation.client(request.client))
        response = admission_pb2.GetUsageResponse(
            key=_key(usage.key),
            pending=usage.pending,
            cap=usage.cap,
            client_tokens=usage.client_tokens,
            client_capacity=usage.client_capacity,
            cluster_tokens=usage.cluster_tokens,
            cluster_capacity=usage.cluster_capacity,
            in_flight=usage.in_flight,
            concurrency_limit=usage.concurrency_limit,
            node_slots_held=usage.node_slots_held,
            live_unknown=usage.live_unknown,
        )
        if usage.live is not None:
            response.live = usage.live
        if current_scope() is not None:
            # A caller scoped to some clients sees its key alone: the cluster bucket
            # and the node slots sum every tenant's activations (SPEC O1).
            response.ClearField("cluster_tokens")
            response.ClearField("cluster_capacity")
            response.ClearField("node_slots_held")
        return response


def _key(key: BoundedKey) -> common_pb2.BoundedKey:
    return common_pb2.BoundedKey(key=key.key, kind=KEY_KINDS[key.kind], key_set_version=key.version)
