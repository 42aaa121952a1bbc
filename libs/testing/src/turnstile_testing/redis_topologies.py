"""Running the tests on each Redis topology users run (SPEC F2).

``TURNSTILE_TEST_REDIS`` chooses the topology behind the ``redis_url`` fixture
for the whole run: ``single`` (the default: the shared server
:func:`turnstile_testing.services.find_redis` finds), ``sentinel`` (a primary,
a replica and three sentinels the kit starts) or ``cluster`` (three masters
with a replica each). ``./scripts/test --redis cluster`` sets it. A test marked
``@pytest.mark.redis_topologies("cluster")`` runs on those topologies as well,
in every run: the races and property tests that must hold on a Cluster too.

Tests talk to Redis through :func:`connect`, which builds redis-py's own client
for any of the URLs — unbounded, so a test's own reads never trip a breaker.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.asyncio.sentinel import Sentinel
from redis.crc import key_slot

from turnstile_platform.redis_topology import Topology, parse_redis_url

TOPOLOGY_ENV = "TURNSTILE_TEST_REDIS"
TOPOLOGIES = tuple(topology.value for topology in Topology)


def default_topology() -> str:
    """The topology this run's ``redis_url`` uses unless a test asks for another."""
    chosen = os.environ.get(TOPOLOGY_ENV, Topology.SINGLE.value)
    if chosen not in TOPOLOGIES:
        raise pytest.UsageError(f"{TOPOLOGY_ENV} must be one of {', '.join(TOPOLOGIES)}")
    return chosen


class InitializedCluster(RedisCluster):
    """redis-py's ``RedisCluster`` that reads the slot map before its first command.

    redis-py 8.1 chooses a command's routing policy before it reads the slot map,
    so on a fresh client every command issued before that read is sent to the
    default node as if it had no key and comes back ``MOVED``; with a few dozen
    such commands at once it counts them as a stale map, closes every node's
    connections under the other commands and they fail with ``ConnectionError`` or
    an ``AttributeError`` from a connection closed mid-connect (a 40-way burst of
    ``SET`` on a fresh client failed so in 83 of 200 runs). Reading the map first
    (once, behind redis-py's own lock) routes every command right the first time,
    as the services' :class:`~turnstile_platform.redis_cluster.BoundedRedisCluster`
    does.
    """

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        if self._initialize:
            await self.initialize()
        return await super().execute_command(*args, **kwargs)


def connect(url: str) -> aioredis.Redis | RedisCluster:
    """A plain redis-py client of the deployment ``url`` names (any topology)."""
    target = parse_redis_url(url)
    if target.topology is Topology.SINGLE:
        return aioredis.Redis.from_url(url)
    auth: dict[str, Any] = {
        "username": target.username,
        "password": target.password,
        "ssl": target.tls,
    }
    if target.topology is Topology.SENTINEL:
        sentinel = Sentinel(list(target.nodes), socket_timeout=5)
        client: aioredis.Redis = sentinel.master_for(target.service, db=target.db, **auth)
        return client
    return InitializedCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes], **auth
    )


def single_server_port(url: str) -> int:
    """The port of the one server ``url`` names; skips the test on Sentinel or Cluster
    (e.g. a proxy that stands between the service and one server)."""
    target = parse_redis_url(url)
    if target.topology is not Topology.SINGLE:
        pytest.skip(f"needs one Redis server, not a {target.topology.value}")
    return int(url.rsplit(":", 1)[1].split("/")[0])


async def timed(call: Awaitable[Any]) -> tuple[float, BaseException | None]:
    """How long ``call`` took, and the error it raised, if any."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await call
    except Exception as error:
        return loop.time() - started, error
    return loop.time() - started, None


async def keys_on_two_masters(client: RedisCluster, prefix: str) -> tuple[str, ClusterNode, str]:
    """A key under ``prefix`` (set to 1), the master that serves it, and a key
    another master serves (unset)."""
    key = f"{prefix}{{a}}"
    await client.set(key, 1)
    node = client.get_node_from_key(key)
    assert node is not None
    other = next(
        f"{prefix}{{{n}}}"
        for n in range(100)
        if client.nodes_manager.get_node_from_slot(key_slot(f"{n}".encode())) != node
    )
    return key, node, other
