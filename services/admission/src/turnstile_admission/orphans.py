"""Holds no caller will settle: cancelled as soon as Redis answers.

When the admit script's reply is lost (Redis hung or the connection dropped
after the script ran), admission cannot know whether the hold was taken. An
admitted answer hands the hold id to the caller, who commits or cancels it. A
refusal (a fail-closed policy) hands it to no one, nor does an Admit that ends
without a decision (this replica overloaded, or the caller's deadline passed
while the script ran), so a hold the script did take — with its tokens,
in-flight lease, node slot and pending entry — would stay until it expired.
This cancels it instead: in the background, retried with backoff until Redis
answers or the hold would have expired anyway. Cancelling a hold that was never
taken takes nothing back, but leaves a tombstone for its id: the script may
still be on its way (a send retried, a Cluster redirection followed after the
budget was spent) and takes no hold of a tombstoned id when it gets there.

Runs on every replica (each settles the holds of its own decisions).
"""

from __future__ import annotations

import asyncio
import logging

from prometheus_client import Counter

from turnstile_admission.redis_store import AdmissionStore
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.dependencies import DEPENDENCY_ERRORS

log = logging.getLogger(__name__)

ORPHANS = Counter(
    "turnstile_admission_orphan_cancels_total",
    "Holds no caller will settle (a refusal whose Redis reply was lost, an Admit "
    "that ended without a decision), cancelled in the background, by result "
    "(cancelled, absent: never taken, expired: Redis did not answer before the "
    "hold's own expiry).",
    ["result"],
)


class OrphanedHolds:
    """Background cancels of holds no caller knows about."""

    def __init__(self, store: AdmissionStore, hold_ttl_s: float) -> None:
        self._store = store
        self._ttl_s = hold_ttl_s
        # On every replica: each settles the holds its own calls orphaned.
        self._tasks = BackgroundTasks("admission orphaned holds")

    def cancel(self, hold_id: str) -> None:
        """Cancel ``hold_id`` once Redis answers (returns at once)."""
        self._tasks.spawn(self._cancel(hold_id), name=f"orphaned-hold-{hold_id}")

    async def _cancel(self, hold_id: str) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self._ttl_s
        pause = 0.1
        while loop.time() < deadline:
            try:
                answer = await self._store.cancel(hold_id)
            except DEPENDENCY_ERRORS:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 2.0)
                continue
            ORPHANS.labels("cancelled" if answer.cancelled else "absent").inc()
            if answer.cancelled:
                log.info(
                    "cancelled a hold no caller will settle",
                    extra={"hold_id": hold_id},
                )
            return
        ORPHANS.labels("expired").inc()

    async def close(self) -> None:
        await self._tasks.close()
