"""One activation (or deactivation) of a sandbox at a time, across every replica.

Two layers:

* an in-process lock per sandbox id, so a burst of requests for one sandbox on
  one replica waits in memory instead of each holding a database connection;
* a PostgreSQL session advisory lock on the sandbox id, taken on the connection
  the activation then uses for all its statements, so replicas exclude each
  other too.

The advisory lock belongs to its database session: if the replica dies, or
PostgreSQL drops the connection, the lock goes with it. It can never outlive
its owner, so it needs no expiry.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress

import asyncpg

from turnstile_substrate.db.pool import Connection

#: Namespaces the lock key, so other advisory-lock users of the database cannot collide.
_LOCK_NAMESPACE = "turnstile.substrate.sandbox:"


class LockTimeoutError(Exception):
    """Another activation of the same sandbox held the lock for too long."""


class KeyedLocks:
    """asyncio locks by key, dropped when no one holds or waits for them."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, int]] = {}

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, key: str, timeout_s: float) -> AsyncIterator[None]:
        lock, users = self._locks.get(key, (asyncio.Lock(), 0))
        self._locks[key] = (lock, users + 1)
        try:
            try:
                async with asyncio.timeout(timeout_s):
                    await lock.acquire()
            except TimeoutError as error:
                raise LockTimeoutError(key) from error
            try:
                yield
            finally:
                lock.release()
        finally:
            lock, users = self._locks[key]
            if users == 1:
                del self._locks[key]
            else:
                self._locks[key] = (lock, users - 1)


@asynccontextmanager
async def sandbox_advisory_lock(
    conn: Connection, sandbox_id: str, timeout_s: float
) -> AsyncIterator[None]:
    """Hold the sandbox's advisory lock on ``conn`` for the block.

    The key is a 64-bit hash of the id; two ids that collide only serialise
    each other. A wait longer than ``timeout_s`` raises :class:`LockTimeoutError`.

    The lock is tried, not waited for inside PostgreSQL: each try is one short
    statement bounded by the database budget, so a hung server costs that
    budget (an UNAVAILABLE answer), not the whole lock timeout; a lock held by
    another activation is tried again with a growing pause (10 ms to 100 ms).
    """
    key = _LOCK_NAMESPACE + sandbox_id
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    pause = 0.01
    while not await conn.fetchval("SELECT pg_try_advisory_lock(hashtextextended($1, 0))", key):
        if loop.time() + pause > deadline:
            raise LockTimeoutError(sandbox_id)
        await asyncio.sleep(pause)
        pause = min(pause * 2, 0.1)
    try:
        yield
    finally:
        if not conn.is_closed():
            # Best effort: if this fails the connection is broken, and the pool's
            # reset (pg_advisory_unlock_all) or the session's end releases it.
            with suppress(asyncpg.PostgresError, asyncpg.InterfaceError, OSError, TimeoutError):
                await conn.execute("SELECT pg_advisory_unlock(hashtextextended($1, 0))", key)
