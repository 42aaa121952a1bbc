"""PostgreSQL connection pools whose every acquire and statement is a bounded call.

:func:`create_pool` returns an asyncpg pool that refuses an ``acquire`` at once
while the PostgreSQL breaker is open and counts a failed connect against it; each
connection runs every statement (transaction ``BEGIN``/``COMMIT`` and the release's
rollback included) inside the dependency's :class:`~turnstile_platform.bounded.Guard`.

A connection whose statement spent its budget, met a read-only server (a demoted
primary) or was ended by the server while idle (MagicStack/asyncpg#1069) is closed,
not returned, so the next acquire connects again, with
``target_session_attrs=read-write`` to whichever host is now the primary. Releasing
costs no round trip: asyncpg's reset query runs only on a connection marked as
holding session state (:func:`mark_session_state`), which nothing takes today (a
test fails if session-state SQL appears unmarked). A failing PostgreSQL reaches
callers as one of the two exceptions of :mod:`turnstile_platform.dependencies`,
never an asyncpg error or an ``OSError``. docs/operations.md ("PgBouncer", the
failure table) says what an operator sees.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any, Literal

import asyncpg
from asyncpg.pool import PoolConnectionProxy
from asyncpg.transaction import Transaction

from turnstile_platform.bounded import DEFAULT_OVERLOAD_WAIT_S, BudgetExceededError, Guard
from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable

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


def _unavailable(dependency: str, error: BaseException) -> DependencyUnavailable:
    return DependencyUnavailable(
        dependency, f"{dependency} unavailable: {type(error).__name__}: {error}"
    )


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
    #: Whether the session may hold state past its transaction: the pool then runs
    #: the full reset query when the connection is released (see module doc).
    holds_session_state: bool = False

    def mark_session_state(self) -> None:
        """Say that this session now holds state that outlives a transaction (a session
        advisory lock, ``LISTEN``, a plain ``SET``, a ``WITH HOLD`` cursor): the pool
        resets it on release. Without the mark it would be handed to the next caller."""
        self.holds_session_state = True

    async def add_listener(self, channel: str, callback: Any) -> None:
        """asyncpg's ``LISTEN``, which is session state: marks the connection."""
        self.mark_session_state()
        await super().add_listener(channel, callback)

    async def _bounded(self, method: str, timeout: float | None, *args: Any, **kw: Any) -> Any:
        call = getattr(super(), method)
        guard = self.guard
        if guard is None:
            return await call(*args, timeout=timeout, **kw)
        try:
            async with guard.call(timeout):
                return await call(*args, timeout=timeout, **kw)
        except DependencyOverloaded:
            self.terminate()  # cut off mid-statement
            raise
        except DependencyUnavailable as error:
            if isinstance(error, BudgetExceededError) or isinstance(error.__cause__, _DISCARD):
                self.terminate()
            raise
        except UNAVAILABLE_ERRORS as error:  # an answer that means "cannot serve now"
            if isinstance(error, _DISCARD):
                self.terminate()
            raise _unavailable(guard.dependency, error) from error

    def transaction(
        self,
        *,
        isolation: Literal["read_committed", "read_uncommitted", "serializable", "repeatable_read"]
        | None = None,
        readonly: bool = False,
        deferrable: bool = False,
    ) -> Transaction:
        """asyncpg's transaction, whose ``BEGIN``, ``COMMIT`` and ``ROLLBACK`` fail as
        ``DependencyUnavailable`` when the connection is lost (a switchover or a crash
        closes it between statements; asyncpg then raises ``InterfaceError`` from the
        transaction itself, which no statement's guard sees)."""
        return _BoundedTransaction(self, isolation, readonly, deferrable)

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


class _BoundedTransaction(Transaction):
    """An asyncpg ``Transaction`` whose own failures are translated (see
    :meth:`BoundedConnection.transaction`); the statements inside are guarded
    already, and their errors pass through unchanged."""

    __slots__ = ()

    def _dependency(self) -> str:
        guard = getattr(self._connection, "guard", None)  # type: ignore[attr-defined]  # asyncpg's slot, untyped in its stubs
        return guard.dependency if guard is not None else "postgresql"

    async def __aenter__(self) -> None:
        try:
            await super().__aenter__()
        except UNAVAILABLE_ERRORS as error:
            raise _unavailable(self._dependency(), error) from error

    async def __aexit__(self, *exc_info: Any) -> None:
        try:
            await super().__aexit__(*exc_info)
        except UNAVAILABLE_ERRORS as error:
            if isinstance(exc_info[1], DependencyUnavailable):
                raise exc_info[1] from error  # the statement's verdict, not the rollback's
            raise _unavailable(self._dependency(), error) from error


def mark_session_state(conn: asyncpg.Connection | PoolConnectionProxy) -> None:
    """:meth:`BoundedConnection.mark_session_state` for a connection held directly or
    borrowed from the pool (the pool's proxy passes the call on)."""
    mark = getattr(conn, "mark_session_state", None)
    if mark is None:
        raise TypeError(f"{conn!r} is not a bounded connection: no pool would reset it")
    mark()


async def reset_session_state(conn: asyncpg.Connection) -> None:
    """The pool's ``reset``: asyncpg has already rolled back any open transaction and
    dropped listener callbacks; run its reset query only on a connection marked as
    holding session state, so an ordinary release costs no round trip."""
    if not isinstance(conn, BoundedConnection) or not conn.holds_session_state:
        return
    query = conn.get_reset_query()
    if query:
        await conn.execute(query)
    # Only once the reset has run: if it fails, asyncpg closes the connection instead.
    conn.holds_session_state = False


class BoundedPool(asyncpg.Pool):
    """An asyncpg pool that refuses acquires while the breaker is open."""

    def __init__(self, *args: Any, guard: Guard, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard

    async def _acquire(self, timeout: float | None) -> Any:
        self.guard.check()
        try:
            return await super()._acquire(timeout)  # type: ignore[misc]  # private in asyncpg: not in its stubs
        except _UNREACHABLE as error:
            # A refused or dropped connect. A timeout is not counted here: it may
            # only mean every connection was busy (this process's limit); a hung
            # server is counted by the statements that time out on it.
            self.guard.breaker.failure()
            raise _unavailable(self.guard.dependency, error) from error
        except UNAVAILABLE_ERRORS as error:
            raise _unavailable(self.guard.dependency, error) from error


async def create_pool(
    dsn: str,
    *,
    guard: Guard,
    min_size: int,
    max_size: int,
    application_name: str,
    reset: Callable[[asyncpg.Connection], Awaitable[None]] | None = reset_session_state,
    **connect_kwargs: Any,
) -> BoundedPool:
    """A bounded pool to ``dsn`` (see the module doc); ``min_size`` connections are
    opened now, which raises ``DependencyUnavailable`` if PostgreSQL cannot be
    reached. ``reset=None`` restores asyncpg's full reset query on every release
    (what the substrate's release benchmark compares against)."""

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
        reset=reset,
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
    try:
        await pool
    except UNAVAILABLE_ERRORS as error:
        raise _unavailable(guard.dependency, error) from error
    return pool
