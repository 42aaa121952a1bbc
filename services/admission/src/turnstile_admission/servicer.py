"""The AdmissionService gRPC handlers: thin, validate → domain → contract."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio

from turnstile_admission import validation
from turnstile_admission.admitter import Admitter, new_hold_id
from turnstile_admission.decision_log import CursorRejectedError, LoggedDecision
from turnstile_admission.responses import (
    MODES,
    POLICIES,
    VERDICTS,
    AdmitResponses,
    hide_shared,
    hide_shared_in_answer,
)
from turnstile_admission.warm_reservations import refusal
from turnstile_clientkeys import BoundedKey
from turnstile_clientkeys.contract import KEY_KINDS
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_platform import shared_limits
from turnstile_platform.authz.ownership import current_identity, current_scope
from turnstile_platform.errors import bad_field

Context = grpc.aio.ServicerContext[Any, Any]


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    def __init__(self, admitter: Admitter) -> None:
        self._admitter = admitter
        self._responses = AdmitResponses()
        self._page_limit = admitter.settings.decision_page_limit
        self._logging = admitter.settings.decision_log.max_entries > 0

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
        if self._logging:
            # The caller's identity, for the decision log (as the authorizer read it).
            identity = current_identity()
            if identity:
                admit = admit._replace(identity=identity)
        decision = await self._admitter.admit(admit)
        response = self._responses.response(decision)
        if shared_limits.hidden():
            hide_shared_in_answer(response)
        return response

    async def ListDecisions(  # noqa: N802
        self, request: admission_pb2.ListDecisionsRequest, context: Context
    ) -> admission_pb2.ListDecisionsResponse:
        # The authorizer allowed this call's client_id (empty: every client's,
        # only for an identity allowed any client), and the read keeps that
        # client's entries alone: a tenant reads its own decisions (SPEC O1).
        query = validation.decisions_query(request, self._page_limit)
        try:
            page = await self._admitter.decisions(query)
        except CursorRejectedError as error:
            # The validation refuses every cursor Redis would; this is its backstop.
            raise bad_field(error.field, f"Redis refused it as a cursor: {error}") from None
        hide = shared_limits.hidden()
        return admission_pb2.ListDecisionsResponse(
            decisions=[_logged(d, hide_shared_limits=hide) for d in page.decisions],
            next_before=page.next_before,
        )

    async def CommitHold(  # noqa: N802
        self, request: admission_pb2.CommitHoldRequest, context: Context
    ) -> admission_pb2.CommitHoldResponse:
        hold_id = validation.hold_id(request.hold_id)
        answer = await self._admitter.commit(hold_id, request.creation_prepaid)
        return admission_pb2.CommitHoldResponse(
            committed=answer.committed, cluster_tokens_returned=answer.cluster_tokens
        )

    async def ReserveWarm(  # noqa: N802
        self, request: admission_pb2.ReserveWarmRequest, context: Context
    ) -> admission_pb2.ReserveWarmResponse:
        # The warm-pool refill's reservation (SPEC W3): the substrate's alone (the
        # shipped policies grant it no tenant); it names no client.
        warm = validation.reserve_warm_request(request)
        reservation = await self._admitter.warm.reserve(new_hold_id(), warm.pod, warm.nodes)
        if not reservation.reserved:
            raise refusal(reservation, warm.tier, warm.pod)
        response = admission_pb2.ReserveWarmResponse(
            hold_id=reservation.hold_id,
            node=reservation.node,
            cluster_tokens=reservation.cluster_tokens,
        )
        response.hold_expires_at.FromMilliseconds(reservation.hold_expires_ms)
        return response

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

    async def GetQueuePosition(  # noqa: N802
        self, request: admission_pb2.GetQueuePositionRequest, context: Context
    ) -> admission_pb2.GetQueuePositionResponse:
        # The authorizer allowed this call's client, and the entry is found by
        # client and wait_id together: another client's wait is not found (SPEC O1).
        client = validation.client(request.client)
        found = await self._admitter.queue_position(
            client, validation.wait_id(request.wait_id, required=True)
        )
        response = admission_pb2.GetQueuePositionResponse(state=_QUEUE_STATES[found.state])
        if found.state == "waiting":
            response.position = found.position
            response.key_waiters = found.key_waiters
            if found.estimated_wait_ms >= 0:
                response.estimated_wait.FromMilliseconds(found.estimated_wait_ms)
        if found.state != "none":
            response.waited.FromMilliseconds(found.waited_ms)
        return response

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


_ACTIVATIONS = {
    "cold_create": common_pb2.ACTIVATION_KIND_COLD_CREATE,
    "warm_claim": common_pb2.ACTIVATION_KIND_WARM_CLAIM,
    "resume": common_pb2.ACTIVATION_KIND_RESUME,
    "restore": common_pb2.ACTIVATION_KIND_RESTORE,
}
_QUEUE_STATES = {
    "waiting": admission_pb2.QUEUE_STATE_WAITING,
    "granted": admission_pb2.QUEUE_STATE_GRANTED,
    "none": admission_pb2.QUEUE_STATE_NOT_FOUND,
}
_KEY_KINDS = {kind.value: value for kind, value in KEY_KINDS.items()}


def _logged(entry: LoggedDecision, *, hide_shared_limits: bool) -> admission_pb2.LoggedDecision:
    """An entry as the caller reads it; ``hide_shared_limits``: a scoped caller's,
    which reads no shared limit's numbers, nor a service's words about them (SPEC N5)."""
    out = admission_pb2.LoggedDecision(
        id=entry.id,
        service=entry.service,
        kind=entry.kind,
        trace_id=entry.trace_id,
        sampled=entry.sampled,
        identity=entry.identity,
        client=entry.client,
        sandbox_id=entry.sandbox_id,
        activation_kind=_ACTIVATIONS.get(entry.activation, common_pb2.ACTIVATION_KIND_UNSPECIFIED),
        hold_id=entry.hold_id,
        node=entry.node,
        detail=shared_limits.detail_for_caller(entry.detail)
        if hide_shared_limits
        else entry.detail,
    )
    out.at.FromMilliseconds(entry.at_ms)
    if entry.key:
        out.key.key = entry.key
        out.key.kind = _KEY_KINDS.get(entry.key_kind, common_pb2.KEY_KIND_UNSPECIFIED)
        out.key.key_set_version = entry.key_set_version
    if entry.hold_expires_ms:
        out.hold_expires_at.FromMilliseconds(entry.hold_expires_ms)
    if entry.waited_ms is not None:
        out.waited.FromMilliseconds(entry.waited_ms)
    if entry.change is not None:
        out.change.target, out.change.verb = entry.change.target, entry.change.verb
        out.change.previous, out.change.current = entry.change.previous, entry.change.current
    for v in entry.verdicts:
        added = out.verdicts.add(
            policy=POLICIES[v.policy],
            mode=MODES[v.mode],
            verdict=VERDICTS[v.verdict],
            limit=v.limit,
            current=v.current,
            detail=v.detail,
        )
        if hide_shared_limits:
            hide_shared(added)
    for s in entry.shadow:
        out.shadow_verdicts.add(
            policy=POLICIES[s.policy],
            verdict=admission_pb2.VERDICT_SHADOW_REFUSE if s.over else admission_pb2.VERDICT_PASS,
            limit=s.limit,
            current=s.current,
        )
    return out


def _key(key: BoundedKey) -> common_pb2.BoundedKey:
    return common_pb2.BoundedKey(key=key.key, kind=KEY_KINDS[key.kind], key_set_version=key.version)
