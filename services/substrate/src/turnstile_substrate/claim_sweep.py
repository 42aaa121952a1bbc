"""Deletes the activation claims that dead replicas left behind (leader-only work).

A replica that dies mid-activation leaves its claim row to expire, and the next
activation of that sandbox overwrites it; a sandbox never activated again keeps
the row for ever. This sweep deletes rows whose expiry passed more than
``activation_claim_max_s`` ago: by then no live owner can still be renewing it
(renewal stops at that age), and an owner that stalled that long would have its
final write refused by the fence anyway, as after a takeover.

It runs on the leader only (one ``DELETE`` per pass for the whole fleet), on both
substrates, in chunks so a backlog never holds many row locks at once.
"""

from __future__ import annotations

import asyncio
import logging

import asyncpg
from prometheus_client import Counter

from turnstile_platform.leader import LeaderTerm
from turnstile_substrate.db import claims
from turnstile_substrate.passes import log_failed_pass

log = logging.getLogger(__name__)

STALE_CLAIMS = Counter(
    "turnstile_substrate_stale_claims_removed_total",
    "Activation claims deleted by the leader because their owner died mid-activation "
    "and nobody activated the sandbox since.",
)

#: Rows deleted per statement.
CHUNK = 500


class StaleClaimSweep:
    """Every ``interval_s``: delete claims expired for longer than ``expired_for_s``."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        expired_for_s: float,
        interval_s: float,
        database_timeout_s: float,
    ) -> None:
        self._pool = pool
        self._expired_for_s = expired_for_s
        self._interval_s = interval_s
        self._db_timeout_s = database_timeout_s

    async def run(self, term: LeaderTerm) -> None:
        """The leader work: a pass now, then one every ``interval_s``."""
        del term  # one DELETE per pass; a second leader's pass would only find nothing
        while True:
            try:
                await self.sweep_once()
            except Exception as error:
                log_failed_pass(log, "sweeping stale activation claims", error)
            await asyncio.sleep(self._interval_s)

    async def sweep_once(self) -> int:
        """Delete every stale claim, a chunk per statement; returns how many."""
        removed = 0
        while True:
            async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
                deleted = await claims.delete_expired(conn, self._expired_for_s, CHUNK)
            removed += deleted
            STALE_CLAIMS.inc(deleted)
            if deleted < CHUNK:
                break
        if removed:
            log.info("deleted %d stale activation claims", removed)
        return removed
