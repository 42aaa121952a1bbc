"""Waking an absent sandbox through substrate ``Activate(sandbox, client=inherit)``.

A wake is a data-plane wake: it acts for the sandbox's recorded client (SPEC C1,
C4), so it is charged to whoever created the sandbox, not to the platform. It
runs in the background: Place answers "pending" at once and the session's
client retries; the wake only has to bring the worker back within the grace.
Which call wakes is decided in Redis (``place.lua``'s wake marker), so one
absence is woken once across every replica.
"""

from __future__ import annotations

import asyncio
import logging

import grpc
import grpc.aio

from turnstile_affinity.metrics import WAKES
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.errors import decode

log = logging.getLogger(__name__)

_REFUSALS = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)


class Waker:
    """Sends wakes in the background and keeps track of them until shutdown."""

    def __init__(
        self, substrate: substrate_pb2_grpc.SubstrateServiceAsyncStub, timeout_s: float
    ) -> None:
        self._substrate = substrate
        self._timeout_s = timeout_s
        self._tasks: set[asyncio.Task[None]] = set()

    def wake(self, sandbox_id: str, tier: str) -> None:
        """Start waking ``sandbox_id``; the span context of the caller is kept."""
        task = asyncio.create_task(self._activate(sandbox_id, tier), name=f"wake {sandbox_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _activate(self, sandbox_id: str, tier: str) -> None:
        request = substrate_pb2.ActivateRequest(
            sandbox_id=sandbox_id,
            client=common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit()),
            tier=tier,
        )
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
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
