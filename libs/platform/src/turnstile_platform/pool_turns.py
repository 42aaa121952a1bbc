"""Waiting one's turn for a connection of a bounded pool, first come first served.

redis-py's pools raise ``MaxConnectionsError`` at once when every connection is
in use, which a caller would read as "Redis unreachable" (a fail-open policy
admits: more concurrent decisions than connections was an over-admission). Its
``BlockingConnectionPool`` waits, but under a condition lock that wakes one
waiter per event-loop turn (a lock convoy under load). :class:`Turns` is the
waiting without the lock: each returned connection is reserved for the first
waiter, so a newcomer cannot take it first, and handing it over is a
synchronous step, atomic on one event loop. The wait is inside the call's
budget, and the guard judges it like any other wait
(:mod:`turnstile_platform.bounded`).

Used by the pool of one server or Sentinel primary
(:class:`~turnstile_platform.redis_bounded.UncontendedPool`) and by each node of
a Redis Cluster (:mod:`turnstile_platform.redis_cluster_nodes`); each says how
many connections a caller could take now (idle ones plus those still to be made).
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class Turns:
    """FIFO waiters for the connections ``free()`` counts (kept idle or still to be
    made, in use not counted). Not thread-safe: one event loop owns it."""

    def __init__(self, free: Callable[[], int]) -> None:
        self._free = free
        self._waiters: deque[asyncio.Future[None]] = deque()
        #: Connections handed to woken waiters that have not taken them yet.
        self._reserved = 0

    def available(self) -> int:
        """Connections a newcomer could take now: free and not reserved for a waiter."""
        return self._free() - self._reserved

    def must_wait(self) -> bool:
        """Whether a newcomer must queue: someone is ahead of it, or nothing is free."""
        return bool(self._waiters) or self.available() <= 0

    async def wait(self) -> None:
        """Wait until a returned connection is reserved for this caller. On return
        the reservation is lifted, so the caller must take the connection before
        its next await (it then counts in :meth:`available` as free)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._reserved -= 1  # handed a connection, then cancelled: pass it on
                self.hand_over()
            elif waiter in self._waiters:
                self._waiters.remove(waiter)
            raise
        self._reserved -= 1

    def hand_over(self) -> None:
        """Reserve a free connection for each waiter there is one for, in order:
        call it whenever a connection comes back (or one may be made again)."""
        while self._waiters and self.available() > 0:
            waiter = self._waiters.popleft()
            if not waiter.done():
                self._reserved += 1
                waiter.set_result(None)
