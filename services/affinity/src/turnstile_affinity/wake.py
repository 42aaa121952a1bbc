"""Waking an absent sandbox through substrate ``Activate(sandbox, client=inherit)``.

A wake is a data-plane wake: it acts for the sandbox's recorded client (SPEC C1,
C4), so it is charged to whoever created the sandbox, not to the platform. It
runs in the background: Place answers "pending" at once and the session's
client retries; the wake only has to bring the worker back within the grace.
Which call wakes is decided in Redis (``place.lua``'s wake marker), so one
absence is woken once across every replica.

A wake acts for the session's client, not only for the sandbox (SPEC O2): the
session's record names a sandbox id, and that id may since have been recorded to
another client (an operator re-created it for someone else). ``inherit`` would
start that client's sandbox, charged to it, on this tenant's turn, although
placement would then refuse the turn there ("not_owned"). So the wake first reads
the sandbox's record (``GetSandbox``) and sends the ``Activate`` only when its owner
is the session's client, or the native pool where the tier shares it: what
placement would accept. A record re-written between the read and the ``Activate``
is not seen (only an ``any`` caller can re-record a sandbox).

A wake may wait in admission's fair queue when the cluster is contended (SPEC
Q1): its ``Activate`` carries a wait budget, the Place or Prepare caller's
remaining deadline less a margin (no deadline: the wake's own), the way
``Activate`` passes its own deadline down to ``Admit``. A woken session then
waits its turn instead of the wake failing on the first refusal.

Where it runs: on every replica, for the absences its own ``Place`` and
``Prepare`` calls took the wake marker of (``place.lua`` / ``prepare.lua``): one
wake per absence across replicas, held by that replica's
:class:`~turnstile_platform.background.BackgroundTasks` until it ends, and
cancelled at shutdown (the next turn after the absence's grace moves the session
anyway, and a wake cut short leaves its marker, so no other replica repeats it).
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio

from turnstile_affinity.metrics import WAKES
from turnstile_clientkeys import NATIVE
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.errors import decode

log = logging.getLogger(__name__)

_REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class Waker:
    """Sends wakes in the background (every replica its own) and holds them until
    they end or shutdown cancels them."""

    def __init__(
        self,
        substrate: substrate_pb2_grpc.SubstrateServiceAsyncStub,
        timeout_s: float,
        wait_margin_s: float = 1.0,
    ) -> None:
        self._substrate = substrate
        self._timeout_s = timeout_s
        self._wait_margin_s = wait_margin_s
        self._tasks = BackgroundTasks("affinity wakes")

    def wake(
        self,
        sandbox_id: str,
        tier: str,
        client: str,
        shared: bool,
        remaining_s: float | None = None,
    ) -> None:
        """Start waking ``sandbox_id`` for a session of ``client`` (``shared``: the
        tier lets it use the native pool); the span context of the caller is kept.
        ``remaining_s``: the caller's remaining deadline (None: it set none)."""
        window_s = self._timeout_s if remaining_s is None else min(remaining_s, self._timeout_s)
        wait_until = asyncio.get_running_loop().time() + window_s - self._wait_margin_s
        self._tasks.spawn(
            self._activate(sandbox_id, tier, client, shared, wait_until),
            name=f"wake {sandbox_id}",
        )

    async def _owned(self, sandbox_id: str, client: str, shared: bool) -> bool:
        """Whether ``sandbox_id`` is recorded to ``client`` (or to the native pool,
        when ``shared``): the sandboxes a session of ``client`` may be placed on."""
        try:
            response = await self._substrate.GetSandbox(
                substrate_pb2.GetSandboxRequest(sandbox_id=sandbox_id), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as raw:
            error = decode(raw)
            WAKES.labels("failed").inc()
            log.warning(
                "wake of an absent sandbox could not read its owner; not woken",
                extra={"sandbox_id": sandbox_id, "code": error.code.name, "reason": error.reason},
            )
            return False
        sandbox = response.sandbox
        owner = sandbox.activating_client_id if sandbox.HasField("activating_client_id") else ""
        if owner and (owner == client or (shared and owner == NATIVE)):
            return True
        WAKES.labels("not_owned").inc()
        log.warning(
            "wake of an absent sandbox not sent: it is not the session's client's",
            extra={"sandbox_id": sandbox_id, "client": client},
        )
        return False

    async def _activate(
        self, sandbox_id: str, tier: str, client: str, shared: bool, wait_until: float
    ) -> None:
        if not await self._owned(sandbox_id, client, shared):
            return
        request = substrate_pb2.ActivateRequest(
            sandbox_id=sandbox_id,
            client=common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit()),
            tier=tier,
        )
        wait_s = wait_until - asyncio.get_running_loop().time()
        if wait_s > 0:
            request.wait_budget.FromMilliseconds(round(wait_s * 1000))
        try:
            response = await self._substrate.Activate(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as raw:
            error = decode(raw)
            result = "refused" if error.code in _REFUSALS else "failed"
            WAKES.labels(result).inc()
            log.warning(
                "wake of an absent sandbox did not activate it",
                extra={"sandbox_id": sandbox_id, "code": error.code.name, "reason": error.reason},
            )
            return
        already = response.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING
        WAKES.labels("already_running" if already else "activated").inc()
        log.info(
            "woke absent sandbox",
            extra={
                "sandbox_id": sandbox_id,
                "outcome": substrate_pb2.Outcome.Name(response.outcome),
            },
        )

    async def close(self) -> None:
        """Cancel wakes still in flight (shutdown)."""
        await self._tasks.close()

    def __len__(self) -> int:
        """Wakes still in flight."""
        return len(self._tasks)
