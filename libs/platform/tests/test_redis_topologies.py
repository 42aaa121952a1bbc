"""One factory, three topologies (SPEC F2): the URL's scheme picks a single server, a
Sentinel-managed primary or a Cluster; each client is redis-py's own, every call is
bounded and guarded the same way, and scripts, transactions and pub/sub work on each
(real servers: the kit's Sentinel set and Cluster)."""

from __future__ import annotations

import asyncio

import pytest
from pydantic import ValidationError

from turnstile_platform.bounded import BreakerState, BudgetExceededError
from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.redis_client import (
    BoundedClient,
    BoundedRedis,
    BoundedRedisCluster,
    create_redis,
    redis_guard,
)
from turnstile_platform.redis_sentinel import BoundedSentinelRedis
from turnstile_platform.redis_topology import RedisTarget, Topology, parse_redis_url
from turnstile_platform.settings import ServiceSettings
from turnstile_testing.redis_cluster import RedisClusterServers, running_cluster
from turnstile_testing.redis_sentinel import RedisSentinelSet
from turnstile_testing.redis_topologies import keys_on_two_masters, timed

SECRET = "s3cret-Pa55"


def test_a_sentinel_url_names_the_sentinels_the_service_and_the_database() -> None:
    target = parse_redis_url(f"rediss+sentinel://app:{SECRET}@s1:26380,s2/primary/2")
    assert target == RedisTarget(
        Topology.SENTINEL,
        (("s1", 26380), ("s2", 26379)),
        tls=True,
        service="primary",
        db=2,
        username="app",
        password=SECRET,
    )


def test_a_cluster_url_names_its_seeds_and_database_zero_only() -> None:
    target = parse_redis_url("redis+cluster://n1:7000,n2")
    assert (target.topology, target.nodes, target.tls) == (
        Topology.CLUSTER,
        (("n1", 7000), ("n2", 6379)),
        False,
    )
    assert parse_redis_url("redis+cluster://n1:7000/0").db == 0
    with pytest.raises(ValueError, match="database 0 only"):
        parse_redis_url("redis+cluster://n1:7000/3")


def test_one_server_keeps_its_url() -> None:
    assert parse_redis_url("rediss://u@h:6380/0") == RedisTarget(Topology.SINGLE, (), tls=True)
    assert parse_redis_url("unix:///run/redis.sock?db=1").topology is Topology.SINGLE


@pytest.mark.parametrize(
    ("url", "message"),
    [
        (f"redis+sentinel://app:{SECRET}@s1:26379", "/<service>"),
        (f"redis+sentinel://app:{SECRET}@s1:26379/svc/zero", "a number"),
        (f"redis+cluster://app:{SECRET}@n1:6379?read_from_replicas=1", "no query"),
        (f"memcached://app:{SECRET}@n1:6379", "scheme must be one of"),
    ],
)
def test_an_invalid_url_is_refused_without_echoing_it(url: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as refused:
        parse_redis_url(url)
    assert SECRET not in str(refused.value)
    with pytest.raises(ValidationError) as invalid:
        ServiceSettings(redis_url=url)  # type: ignore[arg-type]
    assert "redis_url" in str(invalid.value)
    assert SECRET not in str(invalid.value)


async def _works(client: BoundedClient, prefix: str) -> None:
    """Commands, a script, a MULTI/EXEC pipeline and pub/sub through ``client``."""
    key, other = f"{prefix}{{t}}:a", f"{prefix}{{t}}:b"
    assert await client.set(key, 1)
    incr = client.register_script("return redis.call('INCRBY', KEYS[1], ARGV[1])")
    assert await incr(keys=[key], args=[2]) == 3
    async with client.pipeline(transaction=True) as pipe:
        pipe.incr(key)
        pipe.set(other, "x")
        assert await pipe.execute() == [4, True]
    subscriber = client.pubsub(ignore_subscribe_messages=True)
    try:
        await subscriber.subscribe(f"{prefix}channel")
        assert await client.publish(f"{prefix}channel", "hello") >= 1
        async with asyncio.timeout(5):
            while (message := await subscriber.get_message(timeout=1)) is None:
                pass
        assert message["data"] == b"hello"
    finally:
        await subscriber.aclose()
        await client.delete(key, other)


@pytest.mark.parametrize(
    ("servers", "kind"),
    [("redis_sentinel", BoundedSentinelRedis), ("redis_cluster", BoundedRedisCluster)],
)
async def test_each_topologys_url_gives_its_bounded_client(
    request: pytest.FixtureRequest, servers: str, kind: type, redis_prefix: str
) -> None:
    deployment: RedisSentinelSet | RedisClusterServers = request.getfixturevalue(servers)
    url = deployment.url if isinstance(deployment, RedisSentinelSet) else deployment.seeds_url
    client = create_redis(url, timeout_s=2.0)
    try:
        assert isinstance(client, kind)
        assert client.guard is not None
        await _works(client, redis_prefix)
        assert client.guard.breaker.state is BreakerState.CLOSED
    finally:
        await client.aclose()


async def test_the_sentinel_client_talks_to_the_primary_the_sentinels_name(
    redis_sentinel: RedisSentinelSet,
) -> None:
    client = create_redis(redis_sentinel.url, timeout_s=2.0)
    try:
        assert isinstance(client, BoundedSentinelRedis)
        await client.ping()
        pool = client.connection_pool
        assert pool.connection_kwargs["db"] == 0
        address = await pool.get_master_address()  # type: ignore[attr-defined]
        assert address[1] == redis_sentinel.primary_port()
    finally:
        await client.aclose()


async def test_a_publish_reaches_a_subscriber_on_another_cluster_node(
    redis_cluster: RedisClusterServers, redis_prefix: str
) -> None:
    """Regular (not sharded) pub/sub is broadcast over the cluster bus, so key-set
    changes reach a watcher whose subscription landed on any node."""
    client = create_redis(redis_cluster.seeds_url, timeout_s=2.0)
    assert isinstance(client, BoundedRedisCluster)
    try:
        await client.ping()
        channel = f"{redis_prefix}channel"
        publishing_node = client.get_node_from_key(channel)
        other = next(node for node in client.get_primaries() if node != publishing_node)
        subscriber = client.pubsub(node=other, ignore_subscribe_messages=True)
        try:
            await subscriber.subscribe(channel)
            await client.publish(channel, "hello")  # counts the publishing node's subscribers only
            async with asyncio.timeout(5):
                while (message := await subscriber.get_message(timeout=1)) is None:
                    pass
            assert message["data"] == b"hello"
        finally:
            await subscriber.aclose()
    finally:
        await client.aclose()


async def test_the_single_server_url_still_gives_the_plain_bounded_client(
    single_redis_url: str,
) -> None:
    client = create_redis(single_redis_url)
    try:
        assert type(client) is BoundedRedis
        assert await client.ping()
    finally:
        await client.aclose()


BUDGET_S = 0.3
MARGIN_S = 0.3


async def test_a_paused_cluster_master_costs_its_slots_calls_the_budget_and_no_other_slot(
    redis_prefix: str,
) -> None:
    """A hung master (SIGSTOP: its socket accepts, nothing answers) costs a call to its
    slots no more than the budget, and calls to other masters' slots nothing; after
    it resumes its slots answer again. (The run past the cluster's node timeout is
    in the fault suite.)"""
    with running_cluster() as cluster:  # no replicas: the cluster cannot fail over
        guard = redis_guard(BUDGET_S, failures=1_000)  # every call tried, none refused
        client = create_redis(cluster.seeds_url, timeout_s=BUDGET_S, guard=guard)
        assert isinstance(client, BoundedRedisCluster)
        try:
            hung_key, hung, other_key = await keys_on_two_masters(client, redis_prefix)
            cluster.node(int(hung.port)).pause()
            try:
                for _ in range(3):  # well within the 2 s node timeout
                    seconds, error = await timed(client.get(hung_key))
                    assert isinstance(error, BudgetExceededError)
                    assert isinstance(error, DependencyUnavailable)
                    assert seconds < BUDGET_S + MARGIN_S
                    seconds, error = await timed(client.get(other_key))
                    assert error is None
                    assert seconds < BUDGET_S
            finally:
                cluster.node(int(hung.port)).resume()
            async with asyncio.timeout(10):
                while (await timed(client.get(hung_key)))[1] is not None:  # noqa: ASYNC110 - no event
                    await asyncio.sleep(0.05)
            assert await client.get(hung_key) == b"1"
        finally:
            await client.aclose()
