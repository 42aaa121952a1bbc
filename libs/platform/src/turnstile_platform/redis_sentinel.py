"""A Sentinel-managed Redis primary, through redis-py's own ``Sentinel``.

redis-py asks the sentinels for the primary's address each time it opens a
connection, and turns a ``READONLY`` answer (the old primary, demoted to a
replica) into a ``ConnectionError`` that drops the connection. So after a
failover each call fails over by itself: the connection to the dead or demoted
primary fails, the pool's one quick retry reconnects through the sentinels to
the new primary — all inside the call's budget, which the guard bounds like any
other call (SPEC F2, F3). Until the sentinels have promoted a replica they name
no healthy primary (``MasterNotFoundError``, a ``ConnectionError``): calls fail
as "unreachable", the breaker opens and each policy applies its fail mode.

The breaker alone would find the new primary only at its next probe, up to
``TURNSTILE_BREAKER_OPEN_S`` after the promotion (measured: 0–0.9 s of a 1 s
wait added to a 2.4 s failover). So while the breaker is open a
:class:`FailoverWatch` listens for the sentinels' ``+switch-master`` and lets the
probe go the moment they name a new primary (see there).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool
from redis.exceptions import RedisError

from turnstile_platform.background import BackgroundTasks
from turnstile_platform.bounded import Breaker, BreakerState, Guard
from turnstile_platform.redis_bounded import BoundedRedis, UncontendedPool
from turnstile_platform.redis_internals import idle, in_use

log = logging.getLogger(__name__)

#: The sentinels' event for a completed failover: ``<service> <old ip> <old port>
#: <new ip> <new port>``, published by each sentinel as it learns of it.
SWITCH_MASTER = "+switch-master"
#: How long a watch waits before subscribing again to a sentinel it lost.
RESUBSCRIBE_S = 0.5

Address = tuple[str, int]


class UncontendedSentinelPool(UncontendedPool, SentinelConnectionPool):
    """redis-py's Sentinel pool, without the lock convoy (see :class:`UncontendedPool`)."""

    async def forget(self, old: Address) -> None:
        """Drop connections to ``old`` (a primary the sentinels replaced): idle ones
        now, those in use as they come back, so none is used again (a demoted
        primary would go on answering reads from a replica's data). The next use
        of each reconnects through the sentinels."""
        for connection in in_use(self):
            if _address(connection) == old:
                connection.mark_for_reconnect()
        for connection in list(idle(self)):
            if _address(connection) == old:
                await connection.disconnect(nowait=True)
        if self.master_address is not None and _same(self.master_address, old):
            self.master_address = None


def _address(connection: AbstractConnection) -> Address:
    return (str(getattr(connection, "host", "")), int(getattr(connection, "port", 0)))


def _same(a: tuple[Any, Any], b: tuple[Any, Any]) -> bool:
    return (str(a[0]), int(a[1])) == (str(b[0]), int(b[1]))


class FailoverWatch:
    """While the primary's breaker is open, waits for the sentinels to name a new
    primary; then lets the probe go at once and drops connections to the old one.

    A background job on **every replica** (each has its own client and breaker),
    running only from the breaker's opening to its closing: it subscribes to
    ``+switch-master`` on every sentinel (one announcement is enough; any sentinel
    may be down), then asks once whether they already name another primary than
    the one the pool used (a failover that ended before the subscription). Each
    subscribe and lookup is bounded by the Redis budget; a lost sentinel is
    subscribed to again after :data:`RESUBSCRIBE_S`.
    """

    def __init__(
        self,
        sentinel: Sentinel,
        pool: UncontendedSentinelPool,
        breaker: Breaker,
        budget_s: float,
    ) -> None:
        self._sentinel = sentinel
        self._pool = pool
        self._breaker = breaker
        self._budget_s = budget_s
        self._watching = BackgroundTasks("Redis Sentinel failover watch")
        self._task: asyncio.Task[None] | None = None
        #: The primary the pool was using when the breaker opened.
        self._old: Address | None = None
        #: The new primary last announced (each sentinel announces it).
        self._named: Address | None = None
        #: Set once a listener has subscribed, for the one lookup that follows.
        self._subscribed = asyncio.Event()
        breaker.on_change(self._changed)

    def _changed(self, state: BreakerState) -> None:
        if state is BreakerState.CLOSED:
            self.stop()
        elif state is BreakerState.OPEN and self._task is None:
            address = self._pool.master_address
            self._old = (str(address[0]), int(address[1])) if address else None
            self._subscribed = asyncio.Event()
            self._task = self._watching.spawn(self._watch(), name="sentinel-failover-watch")

    def stop(self) -> None:
        """End the watch (the breaker closed); it unsubscribes on its own."""
        if self._task is not None:
            self._task.cancel()
            self._task = None

    async def close(self) -> None:
        """End the watch and wait until it has unsubscribed (the client is closing)."""
        task, self._task = self._task, None
        if task is not None:
            await self._watching.stop(task)

    async def _watch(self) -> None:
        listeners = [self._listen(client) for client in self._sentinel.sentinels]
        await asyncio.gather(*listeners, self._ask())

    async def _ask(self) -> None:
        """Whether the sentinels name a new primary already: once, after the first
        subscription (so a failover that ends between the two is still heard)."""
        try:
            async with asyncio.timeout(self._budget_s):
                await self._subscribed.wait()
            async with asyncio.timeout(self._budget_s):
                named = await self._sentinel.discover_master(self._pool.service_name)
        except (RedisError, OSError, TimeoutError):
            return  # none yet: the announcement will tell
        if self._old is not None and not _same(named, self._old):
            await self._switched(self._old, (str(named[0]), int(named[1])))

    async def _listen(self, client: aioredis.Redis) -> None:
        service = self._pool.service_name
        while True:
            pubsub = client.pubsub()
            try:
                async with asyncio.timeout(self._budget_s):
                    await pubsub.subscribe(SWITCH_MASTER)
                self._subscribed.set()
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=1.0)
                    if message is None:
                        continue
                    fields = bytes(message["data"]).decode().split()
                    if len(fields) == 5 and fields[0] == service:
                        await self._switched(
                            (fields[1], int(fields[2])), (fields[3], int(fields[4]))
                        )
            except (RedisError, OSError, TimeoutError, ValueError):
                pass  # a sentinel lost (or a malformed announcement): subscribe again
            finally:
                await pubsub.aclose()
            await asyncio.sleep(RESUBSCRIBE_S)

    async def _switched(self, old: Address, new: Address) -> None:
        if self._breaker.state is BreakerState.CLOSED:
            return
        if new != self._named:
            self._named = new
            log.warning(
                "sentinels name a new Redis primary; probing it now",
                extra={"old_primary": f"{old[0]}:{old[1]}", "new_primary": f"{new[0]}:{new[1]}"},
            )
        # Each sentinel's announcement lets one probe go: a second chance, at once,
        # for a probe that met the new primary before it was ready.
        self._breaker.probe_now()
        await self._pool.forget(old)


class BoundedSentinelRedis(BoundedRedis):
    """The primary's client; closing it closes its connections to the sentinels too."""

    sentinel_manager: Sentinel | None = None
    failover_watch: FailoverWatch | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        if self.failover_watch is not None:
            await self.failover_watch.close()
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinel_manager is not None:
                await self.sentinel_manager.aclose()


def sentinel_primary(
    sentinels: tuple[tuple[str, int], ...],
    service: str,
    *,
    guard: Guard,
    sentinel_connection: dict[str, Any],
    **connection: Any,
) -> BoundedSentinelRedis:
    """A client of ``service``'s primary as the ``sentinels`` name it, each call
    under ``guard``, whose breaker the sentinels' failover announcements wake.

    ``sentinel_connection`` configures the connections to the sentinels
    (timeouts, TLS, their own password); ``connection`` those to the primary.
    """
    sentinel = Sentinel(list(sentinels), sentinel_kwargs=sentinel_connection)
    client: BoundedSentinelRedis = sentinel.master_for(
        service,
        redis_class=BoundedSentinelRedis,
        connection_pool_class=UncontendedSentinelPool,
        **connection,
    )
    client.sentinel_manager = sentinel
    pool = client.connection_pool
    assert isinstance(pool, UncontendedSentinelPool)
    client.guard = pool.guard = guard
    client.failover_watch = FailoverWatch(sentinel, pool, guard.breaker, guard.budget_s)
    return client
