"""gRPC health driven by a map of components (envoyproxy/ratelimit style).

The server is SERVING only while every registered component is healthy and no
shutdown has begun; any failing component (Redis down, reflector not synced,
config invalid) flips the overall status and every service name to NOT_SERVING.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from grpc_health.v1 import health, health_pb2

log = logging.getLogger(__name__)

OVERALL = ""

#: A health service name that stays SERVING while the process answers at all:
#: Kubernetes liveness probes check it, so a Redis outage takes replicas out of
#: rotation (readiness, overall status) instead of restarting every one of them.
LIVENESS = "liveness"


class HealthMap:
    """Component health folded into the standard ``grpc.health.v1`` servicer."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self.servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
        self._names = [OVERALL, *service_names]
        self._components: dict[str, bool] = {}
        self._shutting_down = False

    def register(self, component: str, healthy: bool = False) -> None:
        """Track ``component``; it starts unhealthy unless said otherwise."""
        self._components[component] = healthy

    async def set(self, component: str, healthy: bool) -> None:
        """Record a component's health and republish the overall status."""
        if self._components.get(component) != healthy:
            log.info("health component changed", extra={"component": component, "healthy": healthy})
        self._components[component] = healthy
        await self._publish()

    @property
    def serving(self) -> bool:
        return not self._shutting_down and all(self._components.values())

    @property
    def components(self) -> dict[str, bool]:
        return dict(self._components)

    async def start(self) -> None:
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        await self._publish()

    async def enter_shutdown(self) -> None:
        """NOT_SERVING for good: the first step of a graceful shutdown."""
        self._shutting_down = True
        await self.servicer.enter_graceful_shutdown()

    async def _publish(self) -> None:
        if self._shutting_down:
            return
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self.serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in self._names:
            await self.servicer.set(name, status)


async def monitor(
    health: HealthMap,
    component: str,
    probe: Callable[[], Awaitable[object]],
    *,
    interval_s: float = 2.0,
    timeout_s: float = 1.0,
) -> None:
    """Probe a dependency forever and keep its health component current.

    A probe that raises or takes longer than ``timeout_s`` marks the component
    unhealthy; run it as a background task and cancel it at shutdown.
    """
    health.register(component)
    while True:
        try:
            await asyncio.wait_for(probe(), timeout=timeout_s)
            healthy = True
        except asyncio.CancelledError:
            raise
        except Exception:
            healthy = False
        await health.set(component, healthy)
        await asyncio.sleep(interval_s)
