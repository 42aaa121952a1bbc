"""One activation (or deactivation) of a sandbox at a time, across every replica,
without holding a database connection while it runs (SPEC F5, F7).

Two layers: an in-process lock per sandbox id (:class:`KeyedLocks`), so a burst on
one replica waits in memory, and an **activation claim** row in PostgreSQL
(:class:`SandboxClaims`): owner and expiry, taken by one short statement, renewed
every third of its TTL (for at most ``activation_claim_max_s``) and deleted at the
end. Between those statements the activation borrows no connection, so a pool bounds
concurrent statements, not activations, and PgBouncer in transaction mode works
(unlike the session advisory lock this replaced; for the same reason a claim held
elsewhere is polled, not ``LISTEN``-ed for). A dead replica's claim expires and is
taken over; its late final write is **fenced** (:func:`turnstile_substrate.db.claims.fence`).
docs/substrate.md ("One runtime per sandbox") has the whole protocol.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, nullcontext

import asyncpg

from turnstile_platform.background import BackgroundTasks, run_to_end
from turnstile_substrate.db import claims
from turnstile_substrate.db.claims import Claim
from turnstile_substrate.flights import FlowWaits, WaitKind

log = logging.getLogger(__name__)


class LockTimeoutError(Exception):
    """Another activation of the same sandbox held the lock for too long."""


class KeyedLocks:
    """asyncio locks by key, dropped when no one holds or waits for them. A call
    that has to wait for one counts against its flow's waits (SPEC N2): past the
    flow's bound it is refused at once (:class:`WaitRefusedError`)."""

    def __init__(self, waits: FlowWaits | None = None) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}
        self._waits = waits if waits is not None else FlowWaits(per_flow=1024)

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, key: str, timeout_s: float, flow: str = "") -> AsyncIterator[None]:
        """Hold ``key``'s lock for the block, waiting at most ``timeout_s`` for it (then
        :class:`LockTimeoutError`); a wait is counted against ``flow`` while it lasts."""
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        waiting = self._waits.wait(flow, key, WaitKind.LOCK) if lock.locked() else nullcontext()
        with waiting:  # a refused call leaves no trace
            self._locks[key] = (lock, users + 1)
            try:
                async with asyncio.timeout(timeout_s):
                    await lock.acquire()
            except BaseException as error:
                self._drop(key)
                if isinstance(error, TimeoutError):
                    raise LockTimeoutError(key) from error
                raise
        try:
            yield
        finally:
            lock.release()
            self._drop(key)

    def _drop(self, key: str) -> None:
        lock, users = self._locks[key]
        if users == 1:
            del self._locks[key]
        else:
            self._locks[key] = (lock, users - 1)


class SandboxClaims:
    """Takes, renews and releases activation claims, borrowing a pool connection for
    each statement only (see the module doc)."""

    def __init__(
        self,
        pool: asyncpg.Pool,
        *,
        ttl_s: float,
        max_s: float,
        database_timeout_s: float,
        instance: str | None = None,
    ) -> None:
        self._pool = pool
        self._ttl_s = ttl_s
        self._max_s = max_s
        self._db_timeout_s = database_timeout_s
        self.instance = instance or f"{socket.gethostname()}/{os.getpid()}"
        #: One renewal per held claim, on the replica holding it, for the block's length.
        self._renewals = BackgroundTasks("activation claim renewal")

    @asynccontextmanager
    async def hold(self, sandbox_id: str, timeout_s: float) -> AsyncIterator[Claim]:
        """Hold the sandbox's claim for the block, waiting at most ``timeout_s`` for it
        (then :class:`LockTimeoutError`). The block must pass the claim to its final
        write (``fence``), which is what makes a lost claim harmless."""
        claim = Claim(sandbox_id, f"{self.instance}/{uuid.uuid4().hex[:16]}")
        await self._take(claim, timeout_s)
        renewer = self._renewals.spawn(self._renew(claim), name=f"claim-renewal:{sandbox_id}")
        try:
            yield claim
        finally:
            try:
                await self._renewals.stop(renewer)
            finally:
                await run_to_end(self._release(claim))

    async def _take(self, claim: Claim, timeout_s: float) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        pause = 0.01
        while True:
            async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
                if await claims.try_claim(conn, claim, self._ttl_s):
                    return
            if loop.time() + pause > deadline:
                raise LockTimeoutError(claim.sandbox_id)
            await asyncio.sleep(pause)
            pause = min(pause * 2, 0.1)

    async def _renew(self, claim: Claim) -> None:
        """Every third of the TTL, for at most ``max_s``; stops once the claim is lost."""
        loop = asyncio.get_running_loop()
        interval = self._ttl_s / 3
        stop_at = loop.time() + self._max_s
        while loop.time() + interval <= stop_at:
            await asyncio.sleep(interval)
            try:
                async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
                    renewed = await claims.renew(conn, claim, self._ttl_s)
            except Exception as error:
                # PostgreSQL unreachable: try again next time; if the claim lapses and
                # another owner takes it, this activation's final write is refused.
                log.warning(
                    "renewing an activation claim failed",
                    extra={"sandbox_id": claim.sandbox_id, "error": repr(error)},
                )
                continue
            if not renewed:
                log.warning(
                    "activation claim taken over by another owner",
                    extra={"sandbox_id": claim.sandbox_id},
                )
                return
        log.warning(
            "activation still running after %.0f s: its claim is no longer renewed",
            self._max_s,
            extra={"sandbox_id": claim.sandbox_id},
        )

    async def _release(self, claim: Claim) -> None:
        """Best effort: a claim not deleted expires after its TTL."""
        try:
            async with self._pool.acquire(timeout=self._db_timeout_s) as conn:
                await claims.release(conn, claim)
        except Exception as error:
            log.warning(
                "releasing an activation claim failed; it expires on its own",
                extra={"sandbox_id": claim.sandbox_id, "error": repr(error)},
            )
