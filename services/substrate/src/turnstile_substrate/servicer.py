"""The SubstrateService gRPC handlers: thin, validate → domain → contract."""

from __future__ import annotations

from typing import Any

import grpc.aio

from turnstile_clientkeys import Resolver
from turnstile_contracts import substrate_pb2, substrate_pb2_grpc
from turnstile_platform import shared_limits
from turnstile_platform.authz.ownership import current_identity, current_scope
from turnstile_platform.errors import RichError
from turnstile_platform.tiers import TierConfig
from turnstile_substrate import contract
from turnstile_substrate.activation import Activator

Context = grpc.aio.ServicerContext[Any, Any]


class SubstrateServicer(substrate_pb2_grpc.SubstrateServiceServicer):
    """Each RPC validates its request (INVALID_ARGUMENT names the field and changes
    nothing), calls the :class:`Activator`, and maps the result to the contract.
    Errors are raised as ``RichError``; the platform interceptor sends them.
    Sandbox-addressed calls pass the caller's scope (SPEC O1) to the domain, which
    checks the records it reads against it."""

    def __init__(
        self,
        activator: Activator,
        resolver: Resolver,
        tiers: TierConfig,
        create_margin_s: float = 10.0,
    ) -> None:
        self._activator = activator
        #: Kept back from an Activate's deadline for the create when it waits.
        self._create_margin_s = create_margin_s
        self._tiers = tiers
        self._resolver = resolver
        self._substrate = activator.substrate

    async def Activate(  # noqa: N802 - gRPC method names
        self, request: substrate_pb2.ActivateRequest, context: Context
    ) -> substrate_pb2.ActivateResponse:
        sandbox_id, client, tier = contract.activate_request(request, self._tiers)
        wait_s = contract.wait_budget(request, context.time_remaining(), self._create_margin_s)
        try:
            activation = await self._activator.activate(
                sandbox_id,
                client,
                tier,
                current_scope(),
                wait_s,
                queue_per_client=request.queue_per_client,
                dry_run=request.dry_run,
                identity=current_identity(),
                wait_id=contract.wait_id(request.wait_id),
                remaining_s=context.time_remaining(),
            )
        except RichError as error:
            # A shared limit's refusal, without its numbers for a scoped caller (SPEC N5).
            raise shared_limits.for_caller(error) from None
        return contract.activate_response(activation, self._substrate.name, sandbox_id, tier)

    async def Deactivate(  # noqa: N802 - gRPC method names
        self, request: substrate_pb2.DeactivateRequest, context: Context
    ) -> substrate_pb2.DeactivateResponse:
        sandbox_id = contract.sandbox_id(request.sandbox_id)
        stopped = await self._activator.deactivate(
            sandbox_id,
            current_scope(),
            identity=current_identity(),
            remaining_s=context.time_remaining(),
        )
        return substrate_pb2.DeactivateResponse(stopped=stopped)

    async def CountLiveSandboxes(  # noqa: N802 - gRPC method names
        self, request: substrate_pb2.CountLiveSandboxesRequest, context: Context
    ) -> substrate_pb2.CountLiveSandboxesResponse:
        key, exclude, pending = contract.count_request(request)
        version = self._resolver.version
        count = self._substrate.count_live(key, exclude, pending)
        return contract.count_response(count, version)

    async def GetSandbox(  # noqa: N802 - gRPC method names
        self, request: substrate_pb2.GetSandboxRequest, context: Context
    ) -> substrate_pb2.GetSandboxResponse:
        sandbox_id = contract.sandbox_id(request.sandbox_id)
        found = await self._activator.get(sandbox_id, current_scope())
        if found.record is None and found.runtime is None:
            raise contract.not_found(sandbox_id)
        return substrate_pb2.GetSandboxResponse(
            sandbox=contract.sandbox_view(found, self._substrate.name)
        )

    async def ListSandboxes(  # noqa: N802 - gRPC method names
        self, request: substrate_pb2.ListSandboxesRequest, context: Context
    ) -> substrate_pb2.ListSandboxesResponse:
        page_size, after, client_id = contract.list_request(request)
        found = await self._activator.list(limit=page_size + 1, after=after, client_id=client_id)
        page = found[:page_size]
        response = substrate_pb2.ListSandboxesResponse(
            sandboxes=[contract.sandbox(record, None, self._substrate.name) for record in page]
        )
        if len(found) > page_size:
            response.next_page_token = contract.encode_page_token(page[-1])
        return response
