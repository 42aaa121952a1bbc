"""A Redis Cluster, through redis-py's own ``RedisCluster``, each call bounded.

redis-py follows ``MOVED`` and ``ASK``, waits out ``TRYAGAIN`` and re-reads the
topology after a dropped connection, all inside one call, so the guard's budget
bounds it like any other (SPEC F2, F3). Two things redis-py leaves to its caller
are done here. Errors of a topology change (``CLUSTERDOWN``, ``TRYAGAIN``, an
uncovered slot, a redirection loop, a failed slot-map read) are raised as
:class:`RedisClusterUnavailableError`, a ``ConnectionError``: the breaker counts
them and callers see ``DependencyUnavailable``, for which retrying is right. And a
hung master does not strand the client: redis-py re-reads the topology only after
an error it saw itself, never after a budget cut the call off, so a spent budget
schedules one background refresh (at most one per ``refresh_interval_s``) that
finds the promoted replica; an overloaded call (our own queueing) does not.

Each call's route, the master that owns its slot, is read from its first key
without a round trip (:mod:`turnstile_platform.redis_cluster_nodes`), so a hung
master's calls fail at their budget while other slots go on. Operating a Cluster
is in docs/deploy.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import inspect
import logging
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, TypeVar

from redis.asyncio.cluster import ClusterNode, ClusterPipeline, RedisCluster
from redis.cluster import SLOT_ID
from redis.commands.core import AsyncScript
from redis.event import EventDispatcher
from redis.exceptions import (
    ClusterDownError,
    ClusterError,
    DataError,
    NoScriptError,
    RedisClusterException,
    SlotNotCoveredError,
    TryAgainError,
)
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from turnstile_platform.background import BackgroundTasks
from turnstile_platform.bounded import Guard
from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.redis_bounded import guarded
from turnstile_platform.redis_cluster_nodes import (
    CURRENT_ROUTE,
    BoundedClusterNode,
    BoundedNodesManager,
    RedisClusterUnavailableError,
    Route,
)
from turnstile_platform.redis_internals import cluster_manager, queued_commands

__all__ = [
    "BoundedClusterPipeline",
    "BoundedRedisCluster",
    "ClusterScript",
    "RedisClusterUnavailableError",
]

log = logging.getLogger(__name__)

T = TypeVar("T")


def _topology_error(error: BaseException) -> bool:
    """Whether ``error`` means the cluster could not serve the call right now."""
    if isinstance(error, (ClusterDownError, TryAgainError, SlotNotCoveredError, ClusterError)):
        return True
    if isinstance(error, AttributeError) and _in_redis_connection(error):
        # redis-py disconnects a node's idle connections after an error on it while
        # another command may be taking one of them: that command then writes to a
        # connection whose writer is gone (seen during CLUSTER FAILOVER under load).
        return True
    if type(error) is RedisClusterException:  # a failed topology read (not a usage error)
        cause = error.__cause__
        return isinstance(cause, (RedisConnectionError, RedisTimeoutError, OSError)) or str(
            error
        ).startswith("All slots are not covered")
    return False


def _in_redis_connection(error: BaseException) -> bool:
    """Whether ``error`` was raised inside redis-py's connection code."""
    frame = error.__traceback__
    while frame is not None and frame.tb_next is not None:
        frame = frame.tb_next
    return frame is not None and frame.tb_frame.f_globals.get("__name__") == (
        "redis.asyncio.connection"
    )


async def _translated(call: Coroutine[Any, Any, T]) -> T:
    try:
        return await call
    except Exception as error:
        if _topology_error(error):
            raise RedisClusterUnavailableError(f"Redis Cluster unavailable: {error}") from error
        raise


async def _answers(node: ClusterNode, timeout_s: float) -> bool:
    try:
        async with asyncio.timeout(timeout_s):
            await node.execute_command("PING")
    except Exception:
        return False
    return True


class BoundedRedisCluster(RedisCluster):
    """A ``RedisCluster`` whose every command and pipeline is one guarded call."""

    guard: Guard | None = None
    #: The shortest time between two background topology refreshes: a hung master's
    #: slots resume this long at most after its replica's promotion. A refresh costs
    #: about 4 ms of CPU (pings, then parsing CLUSTER SLOTS), so up to 4 a second
    #: while calls fail is cheap.
    refresh_interval_s: float = 0.25
    #: The bound of the first topology read (see :meth:`_start`).
    start_timeout_s: float = 10.0
    _refresh: asyncio.Task[None] | None = None
    #: Topology refreshes and detached calls (see :meth:`_detached`), on every replica.
    _background: BackgroundTasks
    _refreshed_at: float = float("-inf")

    def __init__(self, *args: Any, guard: Guard | None = None, **kwargs: Any) -> None:
        # Given to redis-py and to the manager below, so neither is read back.
        dispatcher = kwargs.setdefault("event_dispatcher", None) or EventDispatcher()
        dynamic = kwargs.setdefault("dynamic_startup_nodes", True)
        kwargs["event_dispatcher"] = dispatcher
        super().__init__(*args, **kwargs)
        self.guard = guard
        # Before any node is used: redis-py's manager, holding bounded nodes only.
        self.nodes_manager = cluster_manager(
            self.nodes_manager,
            BoundedNodesManager,
            dynamic_startup_nodes=dynamic,
            event_dispatcher=dispatcher,
            guard=guard,
        )
        # On every replica: topology refreshes and detached calls of this client.
        self._background = BackgroundTasks("Redis Cluster client")
        self._started = False

    async def _start(self) -> None:
        """The first read of the slot map and of the server's command table, once per
        process: too much for one call's budget on a busy machine (it parses the whole
        ``COMMAND`` reply), so it has its own bound, ``start_timeout_s``, and is not
        counted by the breaker. Later re-reads happen inside calls, within budget."""
        dependency = "redis" if self.guard is None else self.guard.dependency
        try:
            async with asyncio.timeout(self.start_timeout_s):
                await _translated(self.initialize())
        except TimeoutError:
            raise DependencyUnavailable(
                dependency, f"Redis Cluster topology not read within {self.start_timeout_s:g}s"
            ) from None
        except (RedisClusterException, RedisConnectionError, RedisTimeoutError, OSError) as error:
            raise DependencyUnavailable(
                dependency, f"Redis Cluster unavailable: {error}"
            ) from error
        self._started = True

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        target = kwargs.get("target_nodes")
        return await self._bounded(
            super().execute_command(*args, **kwargs),
            lambda: self._route(target if isinstance(target, ClusterNode) else args),
        )

    def _route(self, served: ClusterNode | Sequence[Any] | None) -> Route | None:
        """The route of a call served by the node ``served`` names, or by the
        master of the slot of the command ``served`` (None: the whole cluster)."""
        if self.guard is None:
            return None
        if served is None or isinstance(served, ClusterNode):
            node = served
        else:
            slot = self._slot_of(served)
            owners = None if slot is None else self.nodes_manager.slots_cache.get(slot)
            node = owners[0] if owners else None
        return Route(self.guard, node if isinstance(node, BoundedClusterNode) else None)

    def _slot_of(self, args: Sequence[Any]) -> int | None:
        """The slot of the command ``args`` from its first key, without a round trip:
        None for a command routed by a flag (every master, a random node) or whose
        keys only the server can find (redis-py asks it with COMMAND GETKEYS), and
        for malformed arguments (redis-py refuses those itself)."""
        try:
            return self._first_key_slot(args)
        except (ValueError, TypeError, IndexError, DataError):
            return None

    def _first_key_slot(self, args: Sequence[Any]) -> int | None:
        command = args[0]
        flag = self.command_flags.get(command)
        if flag is not None:
            return int(args[1]) if flag == SLOT_ID and len(args) > 1 else None
        name = str(command).lower()
        if name in ("eval", "evalsha", "fcall", "fcall_ro"):
            return self.keyslot(args[3]) if len(args) > 3 and int(args[2]) > 0 else None
        info = self.commands_parser.commands.get(name)
        if not isinstance(info, dict) or "movablekeys" in info["flags"]:
            return None
        position = int(info["first_key_pos"])
        return self.keyslot(args[position]) if 0 < position < len(args) else None

    def register_script(self, script: Any) -> ClusterScript:  # type: ignore[override]  # redis-py annotates self as a Union of clients
        return ClusterScript(self, script)

    async def script_load(self, script: Any) -> Any:
        """``SCRIPT LOAD`` on every node, replicas too (redis-py loads on the masters
        only). Redis does not replicate its script cache, so a replica promoted by a
        failover answered ``NOSCRIPT`` to calls redirected to it; and when the slot
        map the reload went by was still the old one (read mid-failover), the reload
        missed the new master and the retried ``EVALSHA`` failed with ``NOSCRIPT``
        again, which callers do not retry (seen as ``INTERNAL`` under a ``CLUSTER
        FAILOVER`` with 64 decisions in flight)."""
        return await self.execute_command("SCRIPT LOAD", script, target_nodes=self.ALL_NODES)

    def pipeline(
        self, transaction: Any | None = None, shard_hint: Any | None = None
    ) -> ClusterPipeline:
        if shard_hint:
            return super().pipeline(transaction, shard_hint)  # raises: no shard hints here
        return BoundedClusterPipeline(self, transaction)  # type: ignore[abstract]  # redis-py's stubs declare a slot abstract

    async def _bounded(self, call: Coroutine[Any, Any, T], route: Callable[[], Route | None]) -> T:
        if not self._started:
            try:
                await self._start()
            except BaseException:
                call.close()
                raise
        try:
            served = route()
            return await guarded(self.guard, self._detached(call, served), served)
        except DependencyUnavailable:
            # Not after DependencyOverloaded: our own queueing, the map is fine.
            self.refresh_topology_soon()
            raise
        finally:
            if inspect.getcoroutinestate(call) == inspect.CORO_CREATED:
                call.close()  # refused by the breaker before it started: never awaited

    async def _detached(self, call: Coroutine[Any, Any, T], route: Route | None) -> T:
        """Await ``call`` in a task of its own, so a cancellation (the budget) returns
        at once. redis-py's cluster client cleans up after a cancelled command before
        it lets the cancellation through — it disconnects from the node, may close
        every node's connections and re-read the slot map — and with a hung master
        that took seconds (measured: 2-3 s past a 0.25 s budget). That cleanup now
        runs on in the background, bounded by the socket timeouts. The task carries
        the call's ``route``, so each node it waits on tells it."""
        context = contextvars.copy_context()
        context.run(CURRENT_ROUTE.set, route)
        task = asyncio.get_running_loop().create_task(_translated(call), context=context)
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            task.cancel()
            self._background.adopt(task)
            raise

    def refresh_topology_soon(self) -> None:
        """Re-read the slot map in the background, unless that was just done."""
        loop = asyncio.get_running_loop()
        if self._refresh is not None and not self._refresh.done():
            return
        if loop.time() - self._refreshed_at < self.refresh_interval_s:
            return
        self._refreshed_at = loop.time()
        self._refresh = self._background.spawn(
            self._refresh_topology(), name="redis-cluster-refresh"
        )

    async def _refresh_topology(self) -> None:
        """Re-read the slot map from a node that answers.

        redis-py asks its seeds one after another, each for up to its socket
        timeout, so a hung node can cost the whole read: every known node is
        pinged at once first, and only those that answered are asked (redis-py
        puts every node it then discovers back among the seeds)."""
        budget = self.guard.budget_s if self.guard is not None else 1.0
        manager = self.nodes_manager
        try:
            seeds = list(manager.startup_nodes.values())
            answered = await asyncio.gather(*(_answers(node, budget) for node in seeds))
            alive = {node.name: node for node, ok in zip(seeds, answered, strict=True) if ok}
            if alive:
                manager.startup_nodes = alive
            async with asyncio.timeout(budget * (len(manager.startup_nodes) + 1)):
                await manager.initialize()
        except Exception:
            log.warning("Redis Cluster topology refresh failed; calls will retry it", exc_info=True)

    async def aclose(self) -> None:
        if self._refresh is not None:
            await self._background.stop(self._refresh)
        await super().aclose()


class ClusterScript(AsyncScript):
    """redis-py's script, whose ``NOSCRIPT`` after its reload is "unreachable".

    redis-py answers ``NOSCRIPT`` by loading the script and calling it again; if
    the reload went by a slot map read mid-failover (the old master still listed,
    the promoted replica not), the second call is redirected to a node that never
    loaded it and fails with ``NOSCRIPT`` too — a script error to callers (an
    ``INTERNAL`` answer), though nothing ran and a retry succeeds. It is raised
    as ``DependencyUnavailable`` instead (each policy's fail mode, retryable),
    and the slot map is re-read."""

    registered_client: BoundedRedisCluster

    async def __call__(
        self, keys: Any | None = None, args: Any | None = None, client: Any | None = None
    ) -> Any:
        try:
            return await super().__call__(keys, args, client)
        except NoScriptError as error:
            client = self.registered_client
            client.refresh_topology_soon()
            raise DependencyUnavailable(
                "redis" if client.guard is None else client.guard.dependency,
                f"Redis Cluster unavailable: the script is not loaded where its slot "
                f"is served ({error})",
            ) from error


class BoundedClusterPipeline(ClusterPipeline):
    """A cluster pipeline whose ``execute`` is one guarded call of its client."""

    cluster_client: BoundedRedisCluster

    async def execute(self, raise_on_error: bool = True, allow_redirections: bool = True) -> Any:
        return await self.cluster_client._bounded(
            super().execute(raise_on_error, allow_redirections), self._route
        )

    def _route(self) -> Route | None:
        """The master of the queued commands' slots if they share one, else the cluster."""
        client = self.cluster_client
        routes = [client._route(command.args) for command in queued_commands(self)]
        nodes = {route.node for route in routes if route is not None}
        return client._route(nodes.pop() if len(nodes) == 1 else None)
