"""Each node of a Redis Cluster judged on its own (SPEC F3 on a Cluster, real servers):
a hung master's calls fail at their budget although the other masters answer
meanwhile, its breaker refuses its slots' calls at once while the others' go on
(the dependency reporting "open" while it is), and a burst beyond a node's
``max_connections`` waits its turn instead of raising ``MaxConnectionsError``."""

from __future__ import annotations

import asyncio

import pytest
from prometheus_client import REGISTRY

from turnstile_platform.bounded import (
    Breaker,
    BreakerOpenError,
    BreakerState,
    BudgetExceededError,
    report_breaker,
)
from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.health import HealthMap
from turnstile_platform.redis_client import (
    BoundedRedisCluster,
    create_redis,
    redis_guard,
)
from turnstile_platform.redis_cluster_nodes import BoundedClusterNode
from turnstile_testing.eventually import eventually
from turnstile_testing.redis_cluster import RedisClusterServers, running_cluster
from turnstile_testing.redis_topologies import keys_on_two_masters, timed

BUDGET_S = 0.3
MARGIN_S = 0.3
#: Far longer than the test: a hung master's call that waited it out would show.
OVERLOAD_WAIT_S = 30.0


async def _load(client: BoundedRedisCluster, key: str, stop: asyncio.Event) -> int:
    """Calls to ``key`` back to back until ``stop``: the answering master's signs of
    life during the hung one's budgets. How many answered."""
    answered = 0
    while not stop.is_set():
        # Past the cluster's node timeout it refuses every slot (CLUSTERDOWN).
        answered += (await timed(client.get(key)))[1] is None
    return answered


@pytest.mark.timeout(60)
async def test_a_hung_masters_call_fails_at_its_budget_while_other_masters_answer(
    redis_prefix: str,
) -> None:
    """With answers from another master throughout, a call to the paused master's
    slot is still cut off at its budget as "silent" (BudgetExceededError, not
    the overload wait): signs of life are the serving node's, not the cluster's."""
    with running_cluster() as cluster:  # no replicas: no failover meanwhile
        guard = redis_guard(BUDGET_S, failures=1_000, overload_wait_s=OVERLOAD_WAIT_S)
        client = create_redis(cluster.seeds_url, timeout_s=BUDGET_S, guard=guard)
        assert isinstance(client, BoundedRedisCluster)
        try:
            hung_key, hung, other_key = await keys_on_two_masters(client, redis_prefix)
            stop = asyncio.Event()
            loads = [asyncio.create_task(_load(client, other_key, stop)) for _ in range(4)]
            cluster.node(int(hung.port)).pause()
            try:
                outcomes = [await timed(client.get(hung_key)) for _ in range(3)]
            finally:
                cluster.node(int(hung.port)).resume()
                stop.set()
            answered = sum(await asyncio.gather(*loads))
            seen = [(round(seconds, 3), type(error).__name__) for seconds, error in outcomes]
            print(f"\nhung master: {seen}; the other answered {answered}")
            assert answered > 10  # the other master answered all along
            for seconds, error in outcomes:
                assert isinstance(error, BudgetExceededError), error
                assert seconds < BUDGET_S + MARGIN_S
        finally:
            await client.aclose()


def _gauge(name: str, **labels: str) -> float | None:
    return REGISTRY.get_sample_value(name, labels)


def _states(breaker: Breaker) -> tuple[BreakerState, BreakerState]:
    """The breaker's own state and the one it reports (with its members')."""
    return breaker.state, breaker.reported


@pytest.mark.timeout(60)
async def test_a_hung_masters_breaker_refuses_its_slots_at_once_and_no_other_slot(
    redis_prefix: str,
) -> None:
    """Two budgets spent on the paused master open its breaker: its slots' calls are
    then refused at once while the other master's succeed; the dependency reports
    open (gauge, reported state, health component) while the node's is, and
    closed again once the resumed master answers the probe."""
    dependency = f"redis-{redis_prefix[2:-1]}"
    with running_cluster() as cluster:
        guard = redis_guard(
            BUDGET_S, failures=2, open_s=0.5, overload_wait_s=OVERLOAD_WAIT_S, dependency=dependency
        )
        client = create_redis(cluster.seeds_url, timeout_s=BUDGET_S, guard=guard)
        assert isinstance(client, BoundedRedisCluster)
        health = HealthMap([])
        health.register("redis", healthy=True)
        report_breaker(health, "redis", guard.breaker)
        try:
            hung_key, hung, other_key = await keys_on_two_masters(client, redis_prefix)
            assert isinstance(hung, BoundedClusterNode)
            assert hung.breaker is not None
            cluster.node(int(hung.port)).pause()
            try:
                for _ in range(2):
                    _, error = await timed(client.get(hung_key))
                    assert isinstance(error, BudgetExceededError), error
                assert _states(hung.breaker)[0] is BreakerState.OPEN
                # The cluster-wide breaker (calls without one slot) stays closed.
                assert _states(guard.breaker) == (BreakerState.CLOSED, BreakerState.OPEN)
                assert _gauge("turnstile_dependency_breaker_state", dependency=dependency) == 2
                node_gauge = _gauge(
                    "turnstile_dependency_node_breaker_state", dependency=dependency, node=hung.name
                )
                assert node_gauge == 2
                await eventually(lambda: not health.components["redis"], timeout_s=2, interval_s=0)
                seconds, error = await timed(client.get(hung_key))
                assert isinstance(error, BreakerOpenError), error
                assert seconds < 0.05
                seconds, error = await timed(client.get(other_key))
                assert error is None
                assert seconds < BUDGET_S
            finally:
                cluster.node(int(hung.port)).resume()
            async with asyncio.timeout(10):
                while (await timed(client.get(hung_key)))[1] is not None:  # noqa: ASYNC110 - no event
                    await asyncio.sleep(0.05)
            assert _states(hung.breaker)[0] is BreakerState.CLOSED
            assert _states(guard.breaker) == (BreakerState.CLOSED, BreakerState.CLOSED)
            assert _gauge("turnstile_dependency_breaker_state", dependency=dependency) == 0
            await eventually(lambda: health.components["redis"], timeout_s=2, interval_s=0)
        finally:
            await client.aclose()


async def test_a_burst_beyond_a_nodes_connections_waits_its_turn(
    redis_cluster: RedisClusterServers, redis_prefix: str
) -> None:
    """200 commands and 40 pipelines at once on one master, whose pool holds 3
    connections: every one answered (redis-py's node raises MaxConnectionsError
    here), and the node never opened more than 3."""
    client = create_redis(redis_cluster.seeds_url, timeout_s=5.0, max_connections=3)
    assert isinstance(client, BoundedRedisCluster)
    key = f"{redis_prefix}{{burst}}"
    try:
        await client.set(key, 0)
        node = client.get_node_from_key(key)
        assert isinstance(node, BoundedClusterNode)

        async def pipelined() -> list[int]:
            async with client.pipeline(transaction=False) as pipe:
                pipe.incr(key)
                pipe.incr(key)
                return await pipe.execute()

        incremented = await asyncio.gather(
            *(client.incr(key) for _ in range(200)), *(pipelined() for _ in range(40))
        )
        assert len(incremented) == 240
        assert await client.get(key) == b"280"
        assert len(node._connections) <= 3
        assert client.guard is not None
        assert client.guard.breaker.reported is BreakerState.CLOSED
    finally:
        await client.delete(key)
        await client.aclose()


async def test_a_call_is_routed_to_the_master_of_its_first_keys_slot(
    redis_cluster: RedisClusterServers, redis_prefix: str
) -> None:
    """The route is read from the command without a round trip: a keyed command or
    script goes to its slot's master (whose breaker counts it); a command for every
    master, a script without keys and malformed arguments go to the whole cluster."""
    client = create_redis(redis_cluster.seeds_url, timeout_s=2.0)
    assert isinstance(client, BoundedRedisCluster)
    key = f"{redis_prefix}{{route}}"
    try:
        await client.ping()
        owner = client.get_node_from_key(key)
        sha = "0" * 40
        keyed = [("GET", key), ("MGET", key, f"{key}:b"), ("ZADD", key, 1, "m")]
        keyed += [("EVALSHA", sha, 1, key, "arg"), ("EVALSHA", sha, "2", key, f"{key}:b")]
        for args in keyed:
            route = client._route(args)
            assert route is not None
            assert route.node is owner, args
            assert isinstance(owner, BoundedClusterNode)
            assert route.breaker is owner.breaker
        for args in [("PING",), ("EVALSHA", sha, 0), ("EVALSHA", sha, "x", key), ("GET",)]:
            route = client._route(args)
            assert route is not None
            assert route.node is None, args
            assert client.guard is not None
            assert route.breaker is client.guard.breaker
    finally:
        await client.aclose()


async def test_a_script_is_loaded_on_every_node_so_a_promoted_replica_has_it(
    redis_cluster: RedisClusterServers, redis_prefix: str
) -> None:
    """Redis does not replicate its script cache: a script loaded on the masters only
    is missing on the replica a failover promotes. The first call of a new script
    (NOSCRIPT, then SCRIPT LOAD) leaves it on every node, replicas included."""
    client = create_redis(redis_cluster.seeds_url, timeout_s=2.0)
    assert isinstance(client, BoundedRedisCluster)
    key = f"{redis_prefix}{{script}}"
    try:
        await client.ping()
        async with asyncio.timeout(20):  # a new cluster lists its replicas once synced
            while not client.get_replicas():
                await asyncio.sleep(0.1)
                await client.nodes_manager.initialize()
        script = client.register_script(f"return '{redis_prefix}' .. KEYS[1]")
        assert await script(keys=[key]) == f"{redis_prefix}{key}".encode()
        for node in client.get_nodes():
            exists = await client.execute_command("SCRIPT EXISTS", script.sha, target_nodes=node)
            assert exists == [True], node
    finally:
        await client.aclose()


async def test_a_script_still_missing_after_its_reload_is_unreachable_not_a_script_error(
    redis_cluster: RedisClusterServers, redis_prefix: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A reload that missed the node serving the slot (it went by a slot map read
    mid-failover: here, a reload that loads nothing) leaves the retried EVALSHA
    with NOSCRIPT: raised as DependencyUnavailable, so callers apply their
    fail mode or retry, never answer INTERNAL."""
    client = create_redis(redis_cluster.seeds_url, timeout_s=2.0)
    assert isinstance(client, BoundedRedisCluster)
    script = client.register_script(f"return '{redis_prefix}'")

    async def missed(text: str) -> str:
        return script.sha

    monkeypatch.setattr(client, "script_load", missed)
    try:
        with pytest.raises(DependencyUnavailable) as raised:
            await script(keys=[f"{redis_prefix}{{missed}}"])
        assert isinstance(raised.value, DependencyUnavailable)
    finally:
        await client.aclose()
