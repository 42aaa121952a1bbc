"""The Redis client every service builds: one factory for every topology (SPEC F2).

:func:`redis_from_settings` (and :func:`create_redis` under it) read the URL's
scheme (:mod:`turnstile_platform.redis_topology`) and build redis-py's own
client for it: ``Redis`` on one server, ``Redis`` over a
``SentinelConnectionPool`` for a Sentinel-managed primary
(:mod:`turnstile_platform.redis_sentinel`), ``RedisCluster`` for a Cluster
(:mod:`turnstile_platform.redis_cluster`). Each is bounded the same way
(:mod:`turnstile_platform.redis_bounded`): every command, pipeline and script
call is one guarded call, and a failing Redis reaches callers as
``DependencyUnavailable`` or ``DependencyOverloaded``
(:mod:`turnstile_platform.dependencies`), never as a redis-py error or an ``OSError``.

Scripts live as ``.lua`` files beside the code that runs them and are loaded
through redis-py's ``Script`` objects, which call EVALSHA and reload the script
on NOSCRIPT (after a Redis restart, a SCRIPT FLUSH or a failover to a replica
that never loaded it) by themselves.
"""

from __future__ import annotations

from importlib import resources
from typing import Any, TypeAlias

import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript

from turnstile_platform.bounded import Guard, report_breaker
from turnstile_platform.health import HealthMonitor
from turnstile_platform.redis_bounded import (
    BoundedPipeline,
    BoundedRedis,
    UncontendedPool,
    redis_guard,
)
from turnstile_platform.redis_cluster import BoundedRedisCluster
from turnstile_platform.redis_sentinel import sentinel_primary
from turnstile_platform.redis_topology import Topology, parse_redis_url
from turnstile_platform.settings import ServiceSettings, read_secret

__all__ = [
    "AnyRedis",
    "BoundedClient",
    "BoundedPipeline",
    "BoundedRedis",
    "BoundedRedisCluster",
    "UncontendedPool",
    "create_redis",
    "load_script",
    "monitor_redis",
    "read_script",
    "redis_from_settings",
    "redis_guard",
]

#: What code that talks to Redis accepts: a client of one server or Sentinel
#: primary, or of a Cluster (the two share the command API but no base class).
AnyRedis: TypeAlias = aioredis.Redis | aioredis.RedisCluster
#: What :func:`create_redis` returns.
BoundedClient: TypeAlias = BoundedRedis | BoundedRedisCluster


def create_redis(
    url: str,
    *,
    timeout_s: float = 0.5,
    max_connections: int = 256,
    guard: Guard | None = None,
    sentinel_password: str | None = None,
    **connection: Any,
) -> BoundedClient:
    """A pooled async client of the deployment ``url`` names; each call bounded
    by ``timeout_s`` and a breaker.

    Timeouts are short on purpose: a policy's fail mode (open or closed) decides
    what happens when Redis stops answering, not a long hang. The guard alone
    decides when a call has waited too long (it tells a silent Redis from our
    own overload), so redis-py's own timeouts stay out of its way. Reads and
    writes on one server and on Sentinel's primary have none: were the socket
    timeout the budget, a reply that a busy event loop reads late would time out
    (and be retried, running a script twice) while Redis had long answered; and
    redis-py bounds each write with ``asyncio.wait_for``, which on Python 3.11
    swallows a cancellation that lands as the write completes (CPython gh-86296,
    fixed in 3.12), so the guard's cut-off would be lost and the call would hang
    until the socket timeout. A Cluster call runs in a task of its own that the
    guard leaves behind at its budget, so there the socket timeout stays, as a
    backstop past the guard's longest wait that ends such a task; the connect
    timeout is the same backstop everywhere. The quick reconnect retries stay,
    inside the call's budget: a dropped connection (a Redis restart, a failover)
    is retried at once without failing the call. ``connection`` (``username``,
    ``password``, ``ssl_ca_certs`` …) overrides what the URL says;
    ``sentinel_password`` is the sentinels' own, if any. ``max_connections``
    bounds the pool (per node on a Cluster).
    """
    target = parse_redis_url(url)
    guard = guard or redis_guard(timeout_s)
    backstop_s = guard.overload_wait_s + guard.budget_s
    common: dict[str, Any] = {
        "socket_timeout": None,
        "socket_connect_timeout": backstop_s,
        "health_check_interval": 10,
        "max_connections": max_connections,
        "decode_responses": False,
    }
    if target.topology is Topology.SINGLE:
        pool = UncontendedPool.from_url(
            url,
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
            **common,
            **connection,
        )
        pool.guard = guard
        single: BoundedRedis = BoundedRedis.from_pool(pool)  # type: ignore[assignment]  # typed as Redis, builds cls
        single.guard = guard
        return single
    auth = {"username": target.username, "password": target.password, **connection}
    tls: dict[str, Any] = {"ssl": True} if target.tls else {}
    if target.topology is Topology.SENTINEL:
        sentinel_tls = {key: value for key, value in auth.items() if key.startswith("ssl_")} | tls
        return sentinel_primary(
            target.nodes,
            target.service,
            guard=guard,
            sentinel_connection={
                "socket_timeout": timeout_s,
                "socket_connect_timeout": timeout_s,
                "password": sentinel_password,
                **sentinel_tls,
            },
            db=target.db,
            # The new primary is usually a reconnect away after a failover.
            retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=2),
            **common,
            **auth,
            **tls,
        )
    return BoundedRedisCluster(
        startup_nodes=[ClusterNode(host, port) for host, port in target.nodes],
        # Each retry re-reads the topology first (a failed node, CLUSTERDOWN).
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=3),
        **(common | {"socket_timeout": backstop_s}),
        **auth,
        **tls,
        guard=guard,
    )


def redis_from_settings(settings: ServiceSettings) -> BoundedClient:
    """A client per the settings: URL (any topology), ACL user, password files,
    TLS CA (SPEC Z4), each call bounded and behind the Redis breaker."""
    connection: dict[str, Any] = {}
    if settings.redis_username:
        connection["username"] = settings.redis_username
    if (password := read_secret(settings.redis_password_file)) is not None:
        connection["password"] = password
    if settings.redis_ca_file is not None and settings.redis_url.scheme.startswith("rediss"):
        connection["ssl_ca_certs"] = str(settings.redis_ca_file)
    return create_redis(
        str(settings.redis_url),
        timeout_s=settings.redis_timeout_s,
        max_connections=settings.redis_max_connections,
        guard=redis_guard(
            settings.redis_timeout_s,
            failures=settings.breaker_failures,
            open_s=settings.breaker_open_s,
            overload_wait_s=settings.overload_wait_s,
        ),
        sentinel_password=read_secret(settings.redis_sentinel_password_file),
        **connection,
    )


def read_script(package: str, name: str) -> str:
    """The text of ``name`` (e.g. ``admit.lua``) shipped in ``package``."""
    return resources.files(package).joinpath(name).read_text(encoding="utf-8")


def load_script(client: AnyRedis, package: str, name: str) -> AsyncScript:
    """A script object bound to ``client``: EVALSHA, reloading on NOSCRIPT."""
    return client.register_script(read_script(package, name))


def monitor_redis(
    monitor: HealthMonitor,
    client: BoundedClient,
    component: str = "redis",
    *,
    readiness: bool = True,
) -> None:
    """Report ``client``'s Redis as a health component: a PING each interval (which
    also probes a half-open breaker), and the breaker's opening and closing at once.
    ``readiness=False`` reports it without taking the server out of rotation."""

    async def ping() -> bool:
        return bool(await client.ping())

    monitor.add(component, ping, readiness=readiness)
    if client.guard is not None:
        report_breaker(monitor.health, component, client.guard.breaker)
