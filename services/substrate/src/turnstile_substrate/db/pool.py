"""The asyncpg connection pool, and the one place database failures are classified."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import asyncpg
from asyncpg.pool import PoolConnectionProxy

from turnstile_substrate.settings import SubstrateSettings

log = logging.getLogger(__name__)

#: A connection, whether held directly or borrowed from the pool.
Connection = asyncpg.Connection | PoolConnectionProxy

#: Failures that mean "PostgreSQL cannot be reached or went away": the request
#: may succeed if retried, and nothing it wrote was committed.
UNAVAILABLE_ERRORS: tuple[type[BaseException], ...] = (
    OSError,
    asyncio.TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.InterfaceError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.QueryCanceledError,
    asyncpg.TooManyConnectionsError,
)


def is_unavailable(error: BaseException) -> bool:
    """Whether ``error`` means PostgreSQL is unreachable (retryable), not a bug."""
    return isinstance(error, UNAVAILABLE_ERRORS)


async def create_pool(settings: SubstrateSettings) -> asyncpg.Pool:
    """A pool to ``TURNSTILE_DATABASE_URL`` that starts even when PostgreSQL is down.

    It opens ``database_pool_min`` connections when PostgreSQL answers; when it
    does not, the service still starts (its health says NOT_SERVING) and the
    pool connects on first use, so PostgreSQL and the service may start in any
    order. A connection PostgreSQL closed is replaced on its next acquisition.
    """
    options: dict[str, Any] = {
        "max_size": settings.database_pool_max,
        "command_timeout": settings.database_timeout_s,
        "timeout": settings.database_timeout_s,
        "server_settings": {"application_name": "turnstile-substrate"},
    }
    min_size = min(settings.database_pool_min, settings.database_pool_max)
    try:
        return await asyncpg.create_pool(str(settings.database_url), min_size=min_size, **options)
    except UNAVAILABLE_ERRORS:
        log.warning("PostgreSQL unreachable at start-up; connecting on first use")
        return await asyncpg.create_pool(str(settings.database_url), min_size=0, **options)
