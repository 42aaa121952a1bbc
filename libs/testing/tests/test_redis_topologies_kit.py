"""The test kit's own Redis clients (``turnstile_testing.redis_topologies.connect``):
on a Cluster, a fresh client's first commands go straight to the master that owns
their slot, so a burst of them on a new client neither fails nor is redirected."""

from __future__ import annotations

import asyncio

import redis

from turnstile_testing.redis_cluster import RedisClusterServers
from turnstile_testing.redis_topologies import connect


def _moved_replies(cluster: RedisClusterServers) -> int:
    """How many ``MOVED`` replies the cluster's nodes have sent since they started."""
    total = 0
    for port in cluster.ports:
        with redis.Redis(host="127.0.0.1", port=port, socket_timeout=2) as node:
            total += int(node.info("errorstats").get("errorstat_MOVED", {}).get("count", 0))
    return total


async def test_a_burst_on_a_fresh_cluster_client_is_routed_right_the_first_time(
    redis_cluster: RedisClusterServers, redis_prefix: str
) -> None:
    moved_before = _moved_replies(redis_cluster)
    for round_ in range(5):
        client = connect(redis_cluster.seeds_url)
        keys = [f"{redis_prefix}{{k{round_}-{i}}}" for i in range(40)]
        try:
            # One key per slot tag, so the burst spreads over every master.
            results = await asyncio.gather(
                *(client.set(key, "v", ex=60) for key in keys), return_exceptions=True
            )
            assert results == [True] * len(keys), [r for r in results if r is not True][:3]
        finally:
            await client.delete(*keys)
            await client.aclose()
    assert _moved_replies(redis_cluster) == moved_before
