"""A Sentinel failover wakes the open breaker (SPEC F2, F3): the client finds the new
primary when the sentinels announce it, not at the breaker's next probe (real
servers: a primary, a replica and three sentinels of this test's own)."""

from __future__ import annotations

import asyncio

import pytest

from turnstile_platform.bounded import BreakerState
from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.redis_client import create_redis, redis_guard
from turnstile_platform.redis_sentinel import BoundedSentinelRedis, UncontendedSentinelPool
from turnstile_testing.redis_sentinel import RedisSentinelSet

#: Far longer than the test: a call that succeeds after the failover was let
#: through by the sentinels' announcement, not by the breaker's own wait.
OPEN_S = 60.0
#: From every sentinel naming the new primary to a successful call: an announcement
#: and one reconnect (the failover itself takes 2-3 s here).
WAKE_S = 1.0


async def test_the_open_breaker_probes_as_soon_as_the_sentinels_name_a_new_primary(
    private_redis_sentinel: RedisSentinelSet,
) -> None:
    sentinel = private_redis_sentinel
    guard = redis_guard(0.3, failures=1, open_s=OPEN_S)
    client = create_redis(sentinel.url, timeout_s=0.3, guard=guard)
    assert isinstance(client, BoundedSentinelRedis)
    try:
        assert await client.set("k", "before")
        assert await client.execute_command("WAIT", 1, 5000) == 1  # on the replica too
        old = sentinel.primary()
        old.stop()
        with pytest.raises(DependencyUnavailable):
            await client.ping()
        assert guard.breaker.state is BreakerState.OPEN
        await asyncio.to_thread(sentinel.wait_for_new_primary, old.port)
        async with asyncio.timeout(WAKE_S):
            while True:  # the breaker is a state, not an event: polled
                try:
                    assert await client.ping()
                    break
                except DependencyUnavailable:
                    await asyncio.sleep(0.02)
        assert guard.breaker.state.name == "CLOSED"  # (mypy: narrowed to OPEN above)
        pool = client.connection_pool
        assert isinstance(pool, UncontendedSentinelPool)
        assert pool.master_address is not None
        assert int(pool.master_address[1]) == sentinel.primary_port() != old.port
        assert await client.get("k") == b"before"  # the promoted replica's data
    finally:
        await client.aclose()


async def test_closing_the_client_ends_a_running_watch(redis_sentinel: RedisSentinelSet) -> None:
    """The watch runs while the breaker is open; closing the client ends it (and its
    subscriptions) before the sentinels' connections close, leaving no task behind."""
    guard = redis_guard(0.3, failures=1, open_s=OPEN_S)
    client = create_redis(redis_sentinel.url, timeout_s=0.3, guard=guard)
    assert await client.ping()
    guard.breaker.failure()  # as an unreachable call would: the watch starts
    watches = [t for t in asyncio.all_tasks() if t.get_name() == "sentinel-failover-watch"]
    assert len(watches) == 1
    await client.aclose()
    assert watches[0].done()
