"""Every use of redis-py's private internals, in one place, checked at import.

The bounded client (:mod:`turnstile_platform.redis_bounded`,
:mod:`turnstile_platform.redis_cluster_nodes`,
:mod:`turnstile_platform.redis_sentinel`) reaches past redis-py's public API in
the few places listed in :data:`PRIVATE`, each for a measured reason given at its
accessor here. No other module names a private attribute of redis-py (a test
scans for them), and :func:`verify` runs when this module is imported: a
redis-py outside :data:`TESTED` or missing one of these attributes stops the
process at start with the attribute's name, instead of failing subtly under load.
The range is pinned in ``libs/platform/pyproject.toml`` and the lock; moving it
means re-running the Redis tests (docs/operations.md) and updating :data:`TESTED`.

Kept because a measurement shows it is needed:

- **The pool's lock, in-use set and idle list** (:func:`pool_lock`,
  :func:`in_use`, :func:`idle`): the pool without a lock convoy. In the
  3,000-worker reattach test redis-py's fair ``asyncio.Lock`` queued calls one
  event-loop turn each, over a second without a single Redis answer in a
  replica, and the breaker opened.
- **A cluster node's connection lists** (:func:`node_connections`): each node
  waits its turn for a connection instead of raising ``MaxConnectionsError``, read
  as "unreachable" by a fail-open policy: answering those by the fail mode, a
  fail-open cap of 7 under a 400-way burst admitted 32 (``test_admission_overload.py``);
  with the wait, 7. The same wait on one server needs only the in-use set.
- **A cluster node's private release after a reconnect**
  (:class:`ClusterNodeReleaseHook`): a connection redis-py disconnects before
  putting it back must hand the next waiter its turn, or that waiter sits until
  its budget (the same overloaded cap race).
- **The pool's event dispatcher** (:func:`event_dispatcher`): the release event
  is dispatched only with a streaming credential provider (its only listener);
  building and dispatching it every call cost 27.4–27.9 → 24.3–24.9 µs for a bare
  ``EVALSHA`` through the client (docs/performance.md).
- **A cluster pipeline's queued commands** (:func:`queued_commands`): a pipeline
  on one master's slots is judged by that master alone (SPEC F3), as its calls are.

Not private, but redis-py's behaviour the client replaces on an instance, also
here (:func:`reporting`): a connection's ``read_response`` reports each reply as
a sign of life (without it a burst that opens connections looks silent and the
guard cuts it off), and its ``pack_command`` packs with hiredis (75 → 12.5 µs for
an ``admit.lua``-sized ``EVALSHA``, docs/performance.md).

Removed for the public API: the Cluster client's manager options
(``dynamic_startup_nodes`` and the event dispatcher are now passed to redis-py
rather than read back from its manager).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Collection, Sequence
from importlib import metadata
from typing import Any

import hiredis
from redis.asyncio.client import Redis
from redis.asyncio.cluster import ClusterNode, ClusterPipeline, NodesManager, RedisCluster
from redis.asyncio.connection import AbstractConnection, Connection, ConnectionPool
from redis.commands.core import AsyncScript
from redis.event import EventDispatcher
from redis.exceptions import DataError

#: The redis-py versions this module was tested with (the package's metadata and
#: the lock pin the same range): ``(lowest, first untested)``.
TESTED: tuple[tuple[int, int], tuple[int, int]] = ((8, 1), (8, 2))

#: The private attributes of redis-py used here, by what holds them.
PRIVATE: dict[str, tuple[str, ...]] = {
    "ConnectionPool": (
        "_lock",
        "_in_use_connections",
        "_available_connections",
        "_event_dispatcher",
    ),
    "ClusterNode": ("_connections", "_free", "_disconnect_and_release"),
    "ClusterPipeline": ("_execution_strategy",),
    "ExecutionStrategy": ("_command_queue",),
}


#: Public attributes redis-py does not document as stable that the client's
#: replacements rely on: ``BoundedScript`` (redis_bounded) calls ``EVALSHA``
#: straight with the script's ``sha``, reloading ``script`` on ``NOSCRIPT``
#: through ``registered_client`` (redis-py's ``__call__`` ran a ``typing.Protocol``
#: ``isinstance``, 2–4 µs a call, docs/performance.md).
RELIED_ON: dict[str, tuple[str, ...]] = {
    "AsyncScript": ("registered_client", "sha", "script"),
}


class RedisInternalsError(RuntimeError):
    """The installed redis-py is not the one this client was tested with."""


def _version(text: str) -> tuple[int, int]:
    major, minor, *_ = text.split(".")
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


def _range() -> str:
    (low_major, low_minor), (high_major, high_minor) = TESTED
    return f">={low_major}.{low_minor},<{high_major}.{high_minor}"


def verify() -> None:
    """Raise :class:`RedisInternalsError` unless redis-py is in :data:`TESTED` and has
    every attribute in :data:`PRIVATE` (checked on objects built without a server)."""
    installed = metadata.version("redis")
    low, high = TESTED
    if not low <= _version(installed) < high:
        raise RedisInternalsError(
            f"redis-py {installed} is installed; turnstile_platform is tested with "
            f"redis {_range()} (it relies on redis-py internals: redis_internals.py)"
        )
    pool = ConnectionPool()
    node = ClusterNode("127.0.0.1", 6379)
    pipeline = ClusterPipeline(RedisCluster(startup_nodes=[node]))  # type: ignore[abstract]  # redis-py's stubs declare a slot abstract
    holders: dict[str, object] = {
        "ConnectionPool": pool,
        "ClusterNode": node,
        "ClusterPipeline": pipeline,
        "ExecutionStrategy": getattr(pipeline, "_execution_strategy", None),
        "AsyncScript": AsyncScript(Redis(), "return 1"),
    }
    for holder, names in (PRIVATE | RELIED_ON).items():
        for name in names:
            if not hasattr(holders[holder], name):
                raise RedisInternalsError(
                    f"redis-py {installed} has no {holder}.{name}; turnstile_platform is "
                    f"tested with redis {_range()} (see redis_internals.py)"
                )


def pool_lock(pool: ConnectionPool) -> asyncio.Lock:
    """The lock redis-py's pool takes to hand out and take back a connection; the
    uncontended pool defers to redis-py only while someone holds it."""
    lock: asyncio.Lock = pool._lock
    return lock


def in_use(pool: ConnectionPool) -> Collection[AbstractConnection]:
    """The pool's connections in use (a ``WeakSet``), for its free count and moves."""
    connections: Collection[AbstractConnection] = pool._in_use_connections
    return connections


def idle(pool: ConnectionPool) -> list[AbstractConnection]:
    """The pool's idle connections, most recently returned last."""
    connections: list[AbstractConnection] = pool._available_connections
    return connections


def put_back(pool: ConnectionPool, connection: AbstractConnection) -> None:
    """Move ``connection`` from in use to idle: redis-py's release without its lock
    (a synchronous step, atomic on one event loop)."""
    pool._in_use_connections.remove(connection)
    pool._available_connections.append(connection)


def event_dispatcher(pool: ConnectionPool) -> EventDispatcher | None:
    """The dispatcher redis-py's pool sends its connection events to."""
    dispatcher: EventDispatcher | None = pool._event_dispatcher
    return dispatcher


def node_connections(node: ClusterNode) -> tuple[int, int]:
    """How many connections ``node`` has made and how many of them are idle."""
    return len(node._connections), len(node._free)


class ClusterNodeReleaseHook(ClusterNode):
    """A cluster node told (:meth:`returned`) when a connection redis-py disconnected
    on release is back among the idle ones (or dropped), redis-py's private step."""

    __slots__ = ()

    async def _disconnect_and_release(self, connection: Connection) -> None:
        try:
            await super()._disconnect_and_release(connection)
        finally:
            self.returned()

    def returned(self) -> None:
        """A connection came back (or may be made again)."""


def queued_commands(pipeline: ClusterPipeline) -> Sequence[Any]:
    """The commands queued on a cluster pipeline (each with ``args``)."""
    queue: Sequence[Any] = pipeline._execution_strategy._command_queue  # type: ignore[attr-defined]  # the strategy's queue is not on its declared type
    return queue


def cluster_manager(
    plain: NodesManager, make: Callable[..., NodesManager], **options: Any
) -> NodesManager:
    """A node manager built by ``make`` with ``plain``'s public settings (the
    dispatcher and ``dynamic_startup_nodes`` are the caller's, given in ``options``)."""
    return make(
        list(plain.startup_nodes.values()),
        plain.require_full_coverage,
        plain.connection_kwargs,
        address_remap=plain.address_remap,
        **options,
    )


def reporting(connection: AbstractConnection, answered: Callable[[], None]) -> AbstractConnection:
    """``connection``, calling ``answered`` on every reply it reads (a sign of life,
    a new connection's handshake included) and packing commands with hiredis."""
    read = connection.read_response

    async def read_response(*args: Any, **kwargs: Any) -> Any:
        response = await read(*args, **kwargs)
        # With a timeout of its own (a pub/sub poll), None means nothing came.
        if response is not None or kwargs.get("timeout") is None:
            answered()
        return response

    connection.read_response = read_response  # type: ignore[method-assign]  # replaced on this instance on purpose
    connection.pack_command = pack_command  # type: ignore[method-assign]  # replaced on this instance on purpose
    return connection


def pack_command(*args: Any) -> list[bytes]:
    """A command in the Redis protocol, packed by hiredis in C.

    redis-py's asyncio connection packs every command in Python (about 60 µs for
    an ``admit.lua`` EVALSHA of 30 arguments, a few percent of a decision's CPU);
    its synchronous connection already uses hiredis's packer when hiredis is
    installed, and this is the same function (``HiredisRespSerializer.pack``):
    the first argument split on spaces (``CONFIG GET``), str encoded as UTF-8,
    numbers by ``repr``, anything else a ``DataError``. A command name without a
    space (``EVALSHA``, nearly every call) goes to hiredis as it is, which encodes
    it as it encodes every str: rebuilding the arguments to split and encode it
    cost 0.3 µs a call (docs/performance.md).
    """
    first = args[0]
    if isinstance(first, str):
        if " " in first:
            args = (*first.encode().split(), *args[1:])
    elif b" " in first:
        args = (*first.split(), *args[1:])
    try:
        return [hiredis.pack_command(args)]
    except TypeError as error:
        raise DataError(str(error)) from error


verify()
