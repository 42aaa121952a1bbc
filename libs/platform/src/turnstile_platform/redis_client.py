"""Redis connections and Lua scripts.

Scripts live as ``.lua`` files beside the code that runs them and are loaded
through redis-py's ``Script`` objects, which call EVALSHA and reload the script
on NOSCRIPT (after a Redis restart or a SCRIPT FLUSH) by themselves.
"""

from __future__ import annotations

from importlib import resources

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.commands.core import AsyncScript
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from turnstile_platform.settings import ServiceSettings

#: Exceptions that mean "Redis could not be reached", as opposed to a script error.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, ConnectionError, TimeoutError, OSError)


def create_redis(url: str, *, timeout_s: float = 0.5, max_connections: int = 256) -> aioredis.Redis:
    """A pooled async client with short timeouts and one quick reconnect retry.

    Timeouts are short on purpose: a policy's fail mode (open or closed) decides
    what happens when Redis is slow, not a long hang.
    """
    return aioredis.Redis.from_url(
        url,
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        health_check_interval=10,
        max_connections=max_connections,
        retry=Retry(ExponentialBackoff(cap=0.1, base=0.01), retries=1),
        decode_responses=False,
    )


def redis_from_settings(settings: ServiceSettings) -> aioredis.Redis:
    return create_redis(str(settings.redis_url), timeout_s=settings.redis_timeout_s)


def read_script(package: str, name: str) -> str:
    """The text of ``name`` (e.g. ``admit.lua``) shipped in ``package``."""
    return resources.files(package).joinpath(name).read_text(encoding="utf-8")


def load_script(client: aioredis.Redis, package: str, name: str) -> AsyncScript:
    """A script object bound to ``client``: EVALSHA, reloading on NOSCRIPT."""
    return client.register_script(read_script(package, name))
