"""PostgreSQL connection pools whose every acquire and statement is a bounded call.

:func:`create_pool` returns an asyncpg pool built on two small subclasses:

* the pool refuses an ``acquire`` at once while the PostgreSQL breaker is open,
  and counts a failed connect (refused, timed out) against it;
* each connection runs every statement (``execute``, ``fetch*``, transaction
  ``BEGIN``/``COMMIT``, the pool's reset on release) inside the dependency's
  :class:`~turnstile_platform.bounded.Guard`: bounded by the budget (or by the
  statement's own ``timeout`` when it gives one), refused while the breaker is
  open. A statement that spent its budget, or met a read-only server (a demoted
  primary after a failover), closes its connection: the server is suspect, and
  the next acquire connects again — with ``target_session_attrs=read-write`` in
  the URL, to whichever host is now the primary.

A connection the server ended while it sat idle in the pool (a failover's fast
shutdown, ``pg_terminate_backend``) is discarded too: the server's last words, a
FATAL error nobody asked for, leave asyncpg's protocol in its error state, and
until the close itself is read the next statement on it fails with
``InternalClientError`` ("cannot switch to state ..; another operation (2) is in
progress", MagicStack/asyncpg#1069) before anything is sent. It is an unavailable
server, not a bug: UNAVAILABLE, and the pool connects again for the next caller.

Multi-host URLs (``postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write``)
are asyncpg's own: it tries the hosts in order and keeps the first that matches.

The errors raised are builtin ``TimeoutError``/``ConnectionError`` subclasses
(:class:`~turnstile_platform.bounded.BudgetExceededError`,
:class:`~turnstile_platform.bounded.BreakerOpenError`) or asyncpg's own, all of
which :data:`UNAVAILABLE_ERRORS` lists: map them to ``UNAVAILABLE`` with a retry
hint, never ``INTERNAL``.
"""

from __future__ import annotations

import asyncio
from typing import Any

import asyncpg

from turnstile_platform.bounded import DEFAULT_OVERLOAD_WAIT_S, Guard

#: Failures that mean "PostgreSQL cannot be reached, went away, or is not the
#: primary": the request may succeed if retried, and nothing it wrote was committed.
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
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.TargetServerAttributeNotMatched,
    # A connection the server ended while idle (see the module doc); asyncpg also
    # raises it for a protocol state it cannot handle, which a retry on a new
    # connection is the right answer to as well.
    asyncpg.InternalClientError,
)

#: What counts against the breaker: the server did not answer or refused to.
_UNREACHABLE: tuple[type[BaseException], ...] = (
    OSError,
    asyncpg.PostgresConnectionError,
    asyncpg.ConnectionDoesNotExistError,
    asyncpg.CannotConnectNowError,
    asyncpg.AdminShutdownError,
    asyncpg.CrashShutdownError,
    asyncpg.TooManyConnectionsError,
    asyncpg.TargetServerAttributeNotMatched,
)

#: Errors after which a connection is closed rather than returned to the pool.
_DISCARD: tuple[type[BaseException], ...] = (
    TimeoutError,
    asyncpg.ReadOnlySQLTransactionError,
    asyncpg.InternalClientError,
)


def is_unavailable(error: BaseException) -> bool:
    """Whether ``error`` means PostgreSQL is unavailable (retryable), not a bug."""
    return isinstance(error, UNAVAILABLE_ERRORS)


def postgres_guard(
    timeout_s: float,
    *,
    failures: int = 3,
    open_s: float = 1.0,
    overload_wait_s: float = DEFAULT_OVERLOAD_WAIT_S,
    dependency: str = "postgresql",
) -> Guard:
    """The budget and breaker of one PostgreSQL deployment."""
    return Guard(
        dependency,
        timeout_s,
        unreachable=_UNREACHABLE,
        failures=failures,
        open_s=open_s,
        overload_wait_s=overload_wait_s,
    )


class BoundedConnection(asyncpg.Connection):
    """An asyncpg connection whose statements are guarded calls (see module doc)."""

    guard: Guard | None = None

    async def _bounded(self, method: str, timeout: float | None, *args: Any, **kw: Any) -> Any:
        call = getattr(super(), method)
        guard = self.guard
        if guard is None:
            return await call(*args, timeout=timeout, **kw)
        try:
            async with guard.call(timeout):
                return await call(*args, timeout=timeout, **kw)
        except _DISCARD:
            self.terminate()
            raise

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:
        result: str = await self._bounded("execute", timeout, query, *args)
        return result

    async def executemany(self, command: str, args: Any, *, timeout: float | None = None) -> None:
        await self._bounded("executemany", timeout, command, args)

    async def fetch(self, query: str, *args: Any, timeout: float | None = None, **kw: Any) -> Any:
        return await self._bounded("fetch", timeout, query, *args, **kw)

    async def fetchval(
        self, query: str, *args: Any, column: int = 0, timeout: float | None = None
    ) -> Any:
        return await self._bounded("fetchval", timeout, query, *args, column=column)

    async def fetchrow(
        self, query: str, *args: Any, timeout: float | None = None, **kw: Any
    ) -> Any:
        return await self._bounded("fetchrow", timeout, query, *args, **kw)

    async def fetchmany(
        self, query: str, args: Any, *, timeout: float | None = None, **kw: Any
    ) -> Any:
        return await self._bounded("fetchmany", timeout, query, args, **kw)


class BoundedPool(asyncpg.Pool):
    """An asyncpg pool that refuses acquires while the breaker is open."""

    def __init__(self, *args: Any, guard: Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    async def _acquire(self, timeout: float | None) -> Any:
        self.guard.check()
        try:
            return await super()._acquire(timeout)  # type: ignore[misc]
        except _UNREACHABLE:
            # A refused or dropped connect. A timeout is not counted here: it may
            # only mean every connection was busy (this process's limit); a hung
            # server is counted by the statements that time out on it.
            self.guard.breaker.failure()
            raise


async def create_pool(
    dsn: str,
    *,
    guard: Guard,
    min_size: int,
    max_size: int,
    application_name: str,
    **connect_kwargs: Any,
) -> BoundedPool:
    """A bounded pool to ``dsn`` (see the module doc); ``min_size`` connections are
    opened now, which raises if PostgreSQL cannot be reached."""

    class Connection(BoundedConnection):
        pass

    Connection.guard = guard
    pool = BoundedPool(
        dsn,
        guard=guard,
        min_size=min_size,
        max_size=max_size,
        max_queries=50_000,
        max_inactive_connection_lifetime=300.0,
        connection_class=Connection,
        record_class=asyncpg.Record,
        loop=None,
        # The guard decides when a statement waited too long (it tells a silent
        # server from this process's own overload); asyncpg's own statement
        # timeout is only a backstop past the guard's longest wait.
        command_timeout=guard.overload_wait_s + guard.budget_s,
        timeout=guard.budget_s,
        server_settings={"application_name": application_name},
        **connect_kwargs,  # password, ssl (SPEC Z4)
    )
    await pool
    return pool
