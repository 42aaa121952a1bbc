"""The substrate's PostgreSQL pool: bounded calls and a breaker from the platform,
and the one place database failures are classified."""

from __future__ import annotations

import logging
import ssl
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.postgres import BoundedPool, postgres_guard
from turnstile_platform.postgres import create_pool as create_bounded_pool
from turnstile_platform.settings import read_secret
from turnstile_substrate.settings import SubstrateSettings

log = logging.getLogger(__name__)

#: A connection, whether held directly or borrowed from the pool.
Connection = asyncpg.Connection | PoolConnectionProxy

__all__ = ["Connection", "create_pool"]


def connection_options(settings: SubstrateSettings) -> dict[str, Any]:
    """Password (from its file) and TLS for asyncpg, per the settings (SPEC Z4)."""
    options: dict[str, Any] = {}
    if (password := read_secret(settings.database_password_file)) is not None:
        options["password"] = password
    mode = settings.database_sslmode
    if mode in ("verify-ca", "verify-full"):
        cafile = settings.database_ssl_root_cert_file
        context = ssl.create_default_context(cafile=str(cafile) if cafile else None)
        context.check_hostname = mode == "verify-full"
        options["ssl"] = context
    elif mode is not None:
        options["ssl"] = mode
    return options


async def create_pool(settings: SubstrateSettings) -> BoundedPool:
    """A pool to ``TURNSTILE_DATABASE_URL`` that starts even when PostgreSQL is down.

    Every acquire and statement is bounded by ``database_timeout_s`` and goes
    through the PostgreSQL breaker (:mod:`turnstile_platform.postgres`). It opens
    ``database_pool_min`` connections when PostgreSQL answers; when it does not,
    the service still starts (its health says NOT_SERVING) and the pool connects
    on first use, so PostgreSQL and the service may start in any order. A
    connection PostgreSQL closed is replaced on its next acquisition.
    """
    guard = postgres_guard(
        settings.database_timeout_s,
        failures=settings.breaker_failures,
        open_s=settings.breaker_open_s,
        overload_wait_s=settings.overload_wait_s,
    )

    async def pool(min_size: int) -> BoundedPool:
        return await create_bounded_pool(
            str(settings.database_url),
            guard=guard,
            min_size=min_size,
            max_size=settings.database_pool_max,
            application_name="turnstile-substrate",
            statement_cache_size=settings.database_statement_cache_size,
            **connection_options(settings),
        )

    try:
        return await pool(min(settings.database_pool_min, settings.database_pool_max))
    except DependencyUnavailable:
        log.warning("PostgreSQL unreachable at start-up; connecting on first use")
        return await pool(0)
