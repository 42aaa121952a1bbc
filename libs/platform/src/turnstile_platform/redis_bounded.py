"""The bounded Redis client: every command, pipeline and script call is one guarded call.

Every call of the clients built here goes through one
:class:`~turnstile_platform.bounded.Guard`: the whole call (pool wait,
reconnect, retry, health-check PING, a Sentinel lookup of the primary, a
Cluster redirection or topology refresh) is bounded by the configured timeout,
and a breaker refuses calls at once after repeated failures. Past the guard a
failing Redis is one of the two exceptions of
:mod:`turnstile_platform.dependencies`, whatever the topology
(:mod:`turnstile_platform.redis_client` builds the client for each); inside the
call redis-py's own retries see its own error types.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.client import Pipeline
from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.commands.core import AsyncScript
from redis.credentials import StreamingCredentialProvider
from redis.event import AsyncAfterConnectionReleasedEvent
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import MaxConnectionsError, NoScriptError
from redis.exceptions import TimeoutError as RedisTimeoutError

from turnstile_platform.bounded import DEFAULT_OVERLOAD_WAIT_S, Guard, Source
from turnstile_platform.pool_turns import Turns
from turnstile_platform.redis_internals import (
    event_dispatcher,
    in_use,
    pool_lock,
    put_back,
    reporting,
)

#: What redis-py raises when Redis could not be reached (a refused or dropped
#: connection, its own socket timeout), as opposed to an answer (a script error):
#: counted by the breaker, and raised past the guard as ``DependencyUnavailable``.
_UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)

T = TypeVar("T")


class UncontendedPool(ConnectionPool):
    """redis-py's pool without a lock convoy on the hot path, waiting its turn
    for a connection when all are in use.

    redis-py's asyncio pool takes an ``asyncio.Lock`` to hand out and take back
    every connection. That lock is fair: once a task waits on it, each release
    wakes the next waiter only on the event loop's next turn, so under load
    (thousands of worker streams, a turn of 100-400 ms) calls queue on it one
    turn each while Redis sits idle, spend their budget there and open the
    breaker (measured in the 3,000-worker reattach test: over a second without
    a single Redis answer in a replica). Taking a connection out and putting it
    back are synchronous list moves, atomic on one event loop, so they need the
    lock only while someone else holds it across an await (a pool-wide
    disconnect, redis-py's maintenance handling); then this defers to redis-py.
    redis-py's optional OpenTelemetry connection counts are not recorded here.
    The pool's private parts it moves are reached through
    :mod:`turnstile_platform.redis_internals`.

    redis-py's plain pool raises ``MaxConnectionsError`` at once when every
    connection is in use, which a caller would read as "Redis unreachable".
    Here the call waits its turn for a connection instead
    (:class:`~turnstile_platform.pool_turns.Turns`: FIFO, inside the call's
    budget, without redis-py's ``BlockingConnectionPool`` condition lock, which
    would bring the convoy back).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._turns = Turns(lambda: self.max_connections - len(in_use(self)))
        #: Told of every reply Redis sends (a sign of life).
        self.guard: Guard | None = None
        self._streaming_credentials = isinstance(
            self.connection_kwargs.get("credential_provider"), StreamingCredentialProvider
        )

    async def get_connection(
        self, command_name: str | None = None, *keys: Any, **options: Any
    ) -> AbstractConnection:
        if pool_lock(self).locked():
            return await super().get_connection(command_name, *keys, **options)  # type: ignore[no-untyped-call,no-any-return]  # unannotated in redis-py (called through a subclass, outside the exemption)
        if self._turns.must_wait():
            await self._turns.wait()
        connection: AbstractConnection = self.get_available_connection()  # type: ignore[no-untyped-call]  # unannotated in redis-py (called through a subclass, outside the exemption)
        try:
            await self.ensure_connection(connection)
        except BaseException:
            await self.release(connection)
            raise
        return connection

    async def ensure_connection(self, connection: AbstractConnection) -> None:
        """redis-py's check of a connection handed out, without its reconnect
        wrapper when the connection is connected and clean.

        redis-py's first step, ``connection.connect()``, runs the connection's
        ``connect_check_health`` under its retry policy (two lambdas and three
        coroutines), and that returns at once for a connected connection; the
        pool took this step on every call (docs/performance.md). Its second,
        whether the connection has unread data (or was closed), is the one
        asked here; a connection that is not connected, has data or fails the
        check goes through redis-py's own steps (reconnect, check again)."""
        if connection.is_connected:
            try:
                if not await connection.can_read():
                    return
            except (RedisConnectionError, RedisTimeoutError, OSError):
                pass  # disconnected by the check: redis-py's steps reconnect it
        await super().ensure_connection(connection)

    def make_connection(self) -> AbstractConnection:
        """A connection that tells the guard of every reply it reads: a burst that
        starts by opening connections (several round trips each) shows Redis
        answering before any call of it completes."""
        connection: AbstractConnection = super().make_connection()  # type: ignore[no-untyped-call]  # unannotated in redis-py (called through a subclass, outside the exemption)
        return reporting(connection, self._answered)

    def _answered(self) -> None:
        if self.guard is not None:
            self.guard.answered()

    async def release(self, connection: AbstractConnection) -> None:
        lock = pool_lock(self)
        if lock.locked():
            await super().release(connection)
            self._turns.hand_over()
            return
        if connection.should_reconnect():
            await connection.disconnect()
        if lock.locked():
            async with lock:
                put_back(self, connection)
        else:
            put_back(self, connection)
        self._turns.hand_over()
        # redis-py's only listener for this event re-authenticates a connection a
        # streaming credential provider has handed a new token; without such a
        # provider it does nothing, and building and dispatching the event was a
        # per-call cost (docs/performance.md).
        dispatcher = event_dispatcher(self)
        if dispatcher is not None and self._streaming_credentials:
            await dispatcher.dispatch_async(AsyncAfterConnectionReleasedEvent(connection))


class BoundedRedis(aioredis.Redis):
    """A redis-py client whose every command and pipeline is one guarded call."""

    guard: Guard | None = None

    async def execute_command(self, *args: Any, **options: Any) -> Any:
        return await guarded(self.guard, super().execute_command(*args, **options))  # type: ignore[no-untyped-call]  # unannotated in redis-py (called through a subclass, outside the exemption)

    def register_script(self, script: Any) -> AsyncScript:  # type: ignore[override]  # redis-py annotates self as a Union of clients
        """A script called straight through EVALSHA (:class:`BoundedScript`)."""
        return BoundedScript(self, script)

    def pipeline(self, transaction: bool = True, shard_hint: str | None = None) -> Pipeline:
        pipe = BoundedPipeline(
            self.connection_pool, self.response_callbacks, transaction, shard_hint
        )
        pipe.guard = self.guard
        return pipe


class BoundedScript(AsyncScript):
    """redis-py's script on a client of one server or Sentinel primary, sending
    the same ``EVALSHA`` and reloading on ``NOSCRIPT`` the same way.

    redis-py's ``AsyncScript.__call__`` asks on every call whether its client is
    a pipeline; redis-py's command mixins are ``typing.Protocol`` classes, so
    that ``isinstance`` runs typing's runtime protocol check (2–4 µs a call on
    this machine, docs/performance.md), and it copies keys and arguments into
    tuples twice. Here the registered client is a :class:`BoundedRedis`, never a
    pipeline (a pipeline's scripts are redis-py's own), so the call goes
    straight to ``execute_command``. A call given another ``client`` is
    redis-py's."""

    registered_client: BoundedRedis

    async def __call__(
        self, keys: Any | None = None, args: Any | None = None, client: Any | None = None
    ) -> Any:
        if client is not None:
            return await super().__call__(keys, args, client)
        redis = self.registered_client
        keys = keys or ()
        args = args or ()
        try:
            return await redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)
        except NoScriptError:
            # Redis restarted, flushed its scripts or failed over to a replica
            # that never loaded it.
            self.sha = await redis.script_load(self.script)
            return await redis.execute_command("EVALSHA", self.sha, len(keys), *keys, *args)


class BoundedPipeline(Pipeline):
    """A pipeline whose ``execute`` (and WATCH-mode commands) are guarded calls.

    Queued commands send nothing, so only what talks to Redis is guarded.
    """

    guard: Guard | None = None

    async def execute(self, raise_on_error: bool = True) -> list[Any]:
        return await guarded(self.guard, super().execute(raise_on_error))

    async def immediate_execute_command(self, *args: Any, **options: Any) -> Any:
        call = super().immediate_execute_command(*args, **options)  # type: ignore[no-untyped-call]  # unannotated in redis-py (called through a subclass, outside the exemption)
        return await guarded(self.guard, call)


async def guarded(guard: Guard | None, call: Awaitable[T], source: Source | None = None) -> T:
    """Await ``call`` as one call under ``guard`` (its budget and breaker; the breaker
    and signs of life of ``source``, one node of the dependency, if given)."""
    if guard is None:
        return await call
    try:
        async with guard.call(source=source):
            return await call
    except BaseException:
        if asyncio.iscoroutine(call):
            call.close()  # refused before it started: never awaited
        raise


def redis_guard(
    timeout_s: float,
    *,
    failures: int = 3,
    open_s: float = 1.0,
    overload_wait_s: float = DEFAULT_OVERLOAD_WAIT_S,
    dependency: str = "redis",
) -> Guard:
    """The budget and breaker of one Redis (an exhausted pool is this process's own
    overload, not Redis's failure)."""
    return Guard(
        dependency,
        timeout_s,
        unreachable=_UNREACHABLE,
        local=(MaxConnectionsError,),
        failures=failures,
        open_s=open_s,
        overload_wait_s=overload_wait_s,
    )
