"""A Sentinel-managed Redis primary, through redis-py's own ``Sentinel``.

redis-py asks the sentinels for the primary's address each time it opens a
connection, and turns a ``READONLY`` answer (the old primary, demoted to a
replica) into a ``ConnectionError`` that drops the connection. So after a
failover each call fails over by itself: the connection to the dead or demoted
primary fails, the pool's one quick retry reconnects through the sentinels to
the new primary — all inside the call's budget, which the guard bounds like any
other call (SPEC F2, F3). Until the sentinels have promoted a replica they name
no healthy primary (``MasterNotFoundError``, a ``ConnectionError``): calls fail
as "unreachable", the breaker opens, each policy applies its fail mode, and the
breaker's probe finds the new primary.
"""

from __future__ import annotations

from typing import Any

from redis.asyncio.sentinel import Sentinel, SentinelConnectionPool

from turnstile_platform.redis_bounded import BoundedRedis, UncontendedPool


class UncontendedSentinelPool(UncontendedPool, SentinelConnectionPool):
    """redis-py's Sentinel pool, without the lock convoy (see :class:`UncontendedPool`)."""


class BoundedSentinelRedis(BoundedRedis):
    """The primary's client; closing it closes its connections to the sentinels too."""

    sentinel_manager: Sentinel | None = None

    async def aclose(self, close_connection_pool: bool | None = None) -> None:
        try:
            await super().aclose(close_connection_pool)
        finally:
            if self.sentinel_manager is not None:
                await self.sentinel_manager.aclose()


def sentinel_primary(
    sentinels: tuple[tuple[str, int], ...],
    service: str,
    *,
    sentinel_connection: dict[str, Any],
    **connection: Any,
) -> BoundedSentinelRedis:
    """A client of ``service``'s primary as the ``sentinels`` name it.

    ``sentinel_connection`` configures the connections to the sentinels
    (timeouts, TLS, their own password); ``connection`` those to the primary.
    """
    sentinel = Sentinel(list(sentinels), sentinel_kwargs=sentinel_connection)  # type: ignore[no-untyped-call]
    client: BoundedSentinelRedis = sentinel.master_for(
        service,
        redis_class=BoundedSentinelRedis,
        connection_pool_class=UncontendedSentinelPool,
        **connection,
    )
    client.sentinel_manager = sentinel
    return client
