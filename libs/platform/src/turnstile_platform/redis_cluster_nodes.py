"""The nodes of a bounded Redis Cluster client, each judged on its own (SPEC F3).

One master can hang while the others answer; were signs of life and the breaker
the whole cluster's, the others' answers would make a call to the hung one look
held up by our own queueing, and one master would close every slot. So each node
has its own signs of life (every reply on its connections), its own breaker
(a member of the dependency's while it is a master) and its own FIFO waiting
pool (:class:`~turnstile_platform.pool_turns.Turns`) instead of redis-py's
``MaxConnectionsError``. A call's :class:`Route` names the master of its slot; a
call without one slot is the whole cluster's, as on one server.

redis-py creates its ``ClusterNode`` objects itself: :class:`BoundedNodesManager`
adopts each as a :class:`BoundedClusterNode` in ``set_nodes``, through which every
slot-map read and redirection passes. ``CLUSTERDOWN`` fails the call at once as
unreachable, not after redis-py's three sleeps and retries (a second the guard
would take for our own slowness). The behaviour is in docs/operations.md ("On a
Redis Cluster each master is judged on its own").
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextvars import ContextVar
from typing import Any

from redis.asyncio.cluster import ClusterNode, NodesManager
from redis.asyncio.connection import Connection
from redis.cluster import PRIMARY
from redis.exceptions import AskError, ClusterDownError, MaxConnectionsError, MovedError
from redis.exceptions import ConnectionError as RedisConnectionError

from turnstile_platform.bounded import Breaker, Guard
from turnstile_platform.pool_turns import Turns
from turnstile_platform.redis_internals import ClusterNodeReleaseHook, node_connections, reporting

#: The route of the cluster call running in this task (set in the call's own task).
CURRENT_ROUTE: ContextVar[Route | None] = ContextVar("turnstile_redis_cluster_route", default=None)


class RedisClusterUnavailableError(RedisConnectionError):
    """The cluster could not serve the call: its topology is changing or unreachable.

    Not redis-py's own ``ConnectionError`` type, so its cluster client does not
    retry it (it retries listed types exactly) but gives it up at once."""


class BoundedClusterNode(ClusterNodeReleaseHook):
    """A cluster node with its own signs of life, breaker and waiting pool."""

    __slots__ = ("_answered_at", "_guard", "_turns", "breaker")

    def __init__(
        self,
        host: str,
        port: str | int,
        server_type: str | None = None,
        *,
        guard: Guard | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(host, port, server_type, **kwargs)
        self._guard = guard
        self._answered_at = float("-inf")
        self._turns = Turns(self._free_connections)
        #: Refuses and counts the calls routed to this node (None: unguarded).
        self.breaker: Breaker | None = None if guard is None else guard.node_breaker(self.name)

    def _free_connections(self) -> int:
        made, idle = node_connections(self)
        return self.max_connections - (made - idle)

    def answered(self) -> None:
        """A sign of life from this node (also one of the whole cluster)."""
        self._answered_at = asyncio.get_running_loop().time()
        if self._guard is not None:
            self._guard.answered()

    def answered_since(self, when: float) -> bool:
        return self._answered_at > when

    def acquire_connection(self) -> Connection:
        """A connection if one is free and not reserved for a waiter; every new one
        reports its replies as this node's signs of life."""
        if self._turns.available() <= 0:
            raise MaxConnectionsError()
        made, _ = node_connections(self)
        connection = super().acquire_connection()
        if node_connections(self)[0] > made:
            reporting(connection, self.answered)
        return connection

    async def execute_command(self, *args: Any, **kwargs: Any) -> Any:
        return await self._in_turn(super().execute_command, *args, **kwargs)

    async def execute_pipeline(self, commands: Any) -> bool:
        return bool(await self._in_turn(super().execute_pipeline, commands))

    async def _in_turn(self, send: Callable[..., Awaitable[Any]], *args: Any, **kwargs: Any) -> Any:
        """Send once this caller's turn for a connection has come, inside the call's
        route (which node served it), with ``CLUSTERDOWN`` as unreachable."""
        route = CURRENT_ROUTE.get()
        if route is not None:
            route.entered(self)
        try:
            if self._turns.must_wait():
                await self._turns.wait()
            # redis-py takes the connection before its first await: the turn holds.
            return await send(*args, **kwargs)
        except ClusterDownError as error:
            raise _cluster_down(error) from error
        finally:
            if route is not None:
                route.left(self)

    def release(self, connection: Connection) -> None:
        super().release(connection)
        self._turns.hand_over()

    def returned(self) -> None:
        self._turns.hand_over()


def _cluster_down(error: ClusterDownError) -> RedisClusterUnavailableError:
    return RedisClusterUnavailableError(f"Redis Cluster unavailable: {error}")


class Route:
    """Where one cluster call's signs of life come from and which breaker counts
    it (a :class:`~turnstile_platform.bounded.Source`): ``node``, the master that
    owned its slot when it started, or the whole cluster (``node`` None)."""

    __slots__ = ("_guard", "_serving", "node")

    def __init__(self, guard: Guard, node: BoundedClusterNode | None) -> None:
        self._guard = guard
        self.node = node if node is not None and node.breaker is not None else None
        #: The nodes the call is waiting on now (more than one: a multi-node command).
        self._serving: list[BoundedClusterNode] = []

    @property
    def breaker(self) -> Breaker:
        if self.node is not None and self.node.breaker is not None:
            return self.node.breaker
        return self._guard.breaker

    def answered(self) -> None:
        if self.node is not None:
            self.node.answered()
        else:
            self._guard.answered()

    def answered_since(self, when: float) -> bool:
        if self.node is None:
            # Any node's reply, as on one server: a call that waits on several
            # (SCRIPT LOAD on every master) would otherwise, on a starved event
            # loop, find one whose reply this process had not read yet and fail.
            return self._guard.answered_since(when)
        if self._serving:
            return all(node.answered_since(when) for node in self._serving)
        return self.node.answered_since(when)

    def entered(self, node: BoundedClusterNode) -> None:
        self._serving.append(node)

    def left(self, node: BoundedClusterNode) -> None:
        self._serving.remove(node)


class BoundedNodesManager(NodesManager):
    """redis-py's node manager, holding :class:`BoundedClusterNode` objects only, and
    keeping the dependency's breaker tracking the current masters' breakers."""

    __slots__ = ("guard",)

    def __init__(self, *args: Any, guard: Guard | None = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.guard = guard
        self.startup_nodes = {name: self.adopt(node) for name, node in self.startup_nodes.items()}

    def adopt(self, node: ClusterNode) -> BoundedClusterNode:
        """``node`` as a bounded node (a new object: redis-py's has no connections yet)."""
        if isinstance(node, BoundedClusterNode):
            return node
        return BoundedClusterNode(
            node.host, node.port, node.server_type, guard=self.guard, **self.connection_kwargs
        )

    def set_nodes(
        self,
        old: dict[str, ClusterNode],
        new: dict[str, ClusterNode],
        remove_old: bool = False,
    ) -> None:
        adopted: dict[str, ClusterNode] = {
            name: node if name in old else self.adopt(node) for name, node in new.items()
        }
        super().set_nodes(old, adopted, remove_old)

    async def initialize(self, *args: Any, **kwargs: Any) -> None:
        try:
            await super().initialize(*args, **kwargs)
        finally:
            self.track()

    async def move_slot(self, e: AskError | MovedError) -> None:
        if self.get_node(host=e.host, port=e.port) is None:
            node = BoundedClusterNode(
                e.host, e.port, PRIMARY, guard=self.guard, **self.connection_kwargs
            )
            self.set_nodes(self.nodes_cache, {node.name: node})
        try:
            await super().move_slot(e)
        finally:
            self.track()

    def track(self) -> None:
        """Make the dependency's breaker report the worst of the masters' breakers."""
        if self.guard is None:
            return
        self.guard.breaker.track(
            node.breaker
            for node in self.nodes_cache.values()
            if node.server_type == PRIMARY
            and isinstance(node, BoundedClusterNode)
            and node.breaker is not None
        )
