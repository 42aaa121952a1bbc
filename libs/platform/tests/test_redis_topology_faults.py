"""Long fault tests of the Cluster client (``./scripts/test -m faults``): a master that
hangs past the cluster's node timeout, and one that dies, on clusters without
replicas (nothing can take over, so the cluster goes down); and a hung master
its replica replaces."""

from __future__ import annotations

import asyncio

import pytest

from turnstile_platform.bounded import Breaker, BreakerState
from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.redis_client import (
    BoundedRedisCluster,
    create_redis,
    redis_guard,
)
from turnstile_testing.redis_cluster import running_cluster
from turnstile_testing.redis_topologies import keys_on_two_masters, timed

BUDGET_S = 0.3
MARGIN_S = 0.3

pytestmark = pytest.mark.faults


@pytest.mark.timeout(120)
async def test_every_call_is_bounded_while_a_master_hangs_past_the_node_timeout(
    redis_prefix: str,
) -> None:
    """For 4 s (twice the node timeout) every call, to any slot, ends within the budget
    as "unreachable": the hung master's by the budget, the others' once the cluster
    has marked it failed and refuses every slot (CLUSTERDOWN)."""
    with running_cluster() as cluster:
        guard = redis_guard(BUDGET_S, failures=1_000)
        client = create_redis(cluster.seeds_url, timeout_s=BUDGET_S, guard=guard)
        assert isinstance(client, BoundedRedisCluster)
        try:
            hung_key, hung, other_key = await keys_on_two_masters(client, redis_prefix)
            loop = asyncio.get_running_loop()
            cluster.node(int(hung.port)).pause()
            seen = []
            try:
                until = loop.time() + 4.0
                while loop.time() < until:
                    seen.append(await timed(client.get(hung_key)))
                    seen.append(await timed(client.get(other_key)))
            finally:
                cluster.node(int(hung.port)).resume()
            longest = max(seconds for seconds, _ in seen)
            errors = [error for _, error in seen if error is not None]
            print(f"\n{len(seen)} calls, {len(errors)} failed, longest {longest * 1000:.0f} ms")
            assert longest < BUDGET_S + MARGIN_S
            assert all(isinstance(error, DependencyUnavailable) for error in errors), errors
            assert seen[-1][1] is not None  # the other master's slots too, by then
            async with asyncio.timeout(20):
                while any([(await timed(client.get(key)))[1] for key in (hung_key, other_key)]):  # noqa: ASYNC110 - cluster state, no event
                    await asyncio.sleep(0.1)
        finally:
            await client.aclose()


@pytest.mark.timeout(120)
async def test_a_cluster_down_after_a_master_died_is_unreachable_not_an_error_reply(
    redis_prefix: str,
) -> None:
    """redis-py retries CLUSTERDOWN, then gives up with it (or with the dead node's
    refused connection): either reaches callers as a ``ConnectionError`` (a fail mode
    applies, the breaker counts it, :class:`DependencyUnavailable` for the
    former), never as a script or command error."""
    with running_cluster() as cluster:
        client = create_redis(cluster.seeds_url, timeout_s=5.0)
        assert isinstance(client, BoundedRedisCluster)
        try:
            _, dead, other_key = await keys_on_two_masters(client, redis_prefix)
            cluster.node(int(dead.port)).stop()
            async with asyncio.timeout(30):
                while (await timed(client.get(other_key)))[1] is None:  # noqa: ASYNC110 - cluster state
                    await asyncio.sleep(0.1)
            errors = [(await timed(client.get(other_key)))[1] for _ in range(5)]
            print(f"\nwith the cluster down: {[type(error).__name__ for error in errors]}")
            assert all(isinstance(error, DependencyUnavailable) for error in errors), errors
        finally:
            await client.aclose()


@pytest.mark.timeout(120)
async def test_a_hung_master_replaced_by_its_replica_no_longer_holds_the_breaker_open(
    redis_prefix: str,
) -> None:
    """A paused master's breaker opens and the dependency reads open; once the cluster
    has promoted its replica, the client's slot-map refresh drops the hung master
    from the breakers the dependency reports, so it reads closed again although
    the old master never answered (it stays paused) — health does not stay
    NOT_SERVING for a node that no longer serves."""
    with running_cluster(replicas=1) as cluster:
        guard = redis_guard(BUDGET_S, failures=2, open_s=0.5)
        client = create_redis(cluster.seeds_url, timeout_s=BUDGET_S, guard=guard)
        assert isinstance(client, BoundedRedisCluster)
        try:
            hung_key, hung, _ = await keys_on_two_masters(client, redis_prefix)
            replica = cluster.replica_of(int(hung.port))
            cluster.node(int(hung.port)).pause()
            try:
                for _ in range(2):
                    assert (await timed(client.get(hung_key)))[1] is not None
                assert guard.breaker.reported is BreakerState.OPEN
                await asyncio.to_thread(cluster.wait_until_master, replica)
                async with asyncio.timeout(20):
                    while (await timed(client.get(hung_key)))[1] is not None:  # noqa: ASYNC110 - cluster state
                        await asyncio.sleep(0.05)
                served_by = client.get_node_from_key(hung_key)
                assert served_by is not None
                assert int(served_by.port) == replica  # (the key may not have replicated)
                assert _reported(guard.breaker) is BreakerState.CLOSED
            finally:
                cluster.node(int(hung.port)).resume()
        finally:
            await client.aclose()


def _reported(breaker: Breaker) -> BreakerState:
    return breaker.reported
