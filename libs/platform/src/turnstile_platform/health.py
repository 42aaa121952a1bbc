"""gRPC health driven by a map of components (envoyproxy/ratelimit style).

The server is SERVING only while every registered component is healthy and no
shutdown has begun; any failing component (Redis down, reflector not synced,
config invalid) flips the overall status and every service name to NOT_SERVING.

Each component is also a health service name of its own (``redis``,
``postgres``, ...), so a probe or an operator can ask about one dependency. A
component registered with ``readiness=False`` is reported only there: it never
takes the server out of rotation. Admission registers Redis that way, because
its policies have fail modes for a Redis outage, and a replica taken out of
rotation could apply none of them.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

from grpc_health.v1 import health, health_pb2
from prometheus_client import Gauge

from turnstile_platform.background import BackgroundTasks

log = logging.getLogger(__name__)

COMPONENT_HEALTHY = Gauge(
    "turnstile_health_component_healthy",
    "1 while a health component (redis, postgres, reflector, ...) is healthy, else 0.",
    ["component"],
)

OVERALL = ""

#: A health service name that stays SERVING while the process answers at all:
#: Kubernetes liveness probes check it, so a Redis outage takes replicas out of
#: rotation (readiness, overall status) instead of restarting every one of them.
LIVENESS = "liveness"


class _HealthServicer(health.aio.HealthServicer):  # type: ignore[misc,name-defined]  # grpcio-health-checking ships no types
    """grpcio-health-checking's servicer plus ``List`` (newer in the proto than in
    the servicer, which raises NotImplementedError and logs a traceback per call)."""

    async def List(  # noqa: N802 - the proto's method name
        self, request: health_pb2.HealthListRequest, context: object
    ) -> health_pb2.HealthListResponse:
        statuses: dict[str, int] = dict(self._server_status)
        return health_pb2.HealthListResponse(
            statuses={
                name: health_pb2.HealthCheckResponse(status=status)
                for name, status in statuses.items()
            }
        )


class HealthMap:
    """Component health folded into the standard ``grpc.health.v1`` servicer."""

    def __init__(self, service_names: Iterable[str]) -> None:
        self.servicer = _HealthServicer()
        self._names = [OVERALL, *service_names]
        self._components: dict[str, bool] = {}
        self._report_only: set[str] = set()
        self._shutting_down = False

    def register(self, component: str, healthy: bool = False, *, readiness: bool = True) -> None:
        """Track ``component``; it starts unhealthy unless said otherwise.

        ``readiness=False``: report it under its own name only, never in the
        overall status (see the module doc)."""
        self._components[component] = healthy
        if not readiness:
            self._report_only.add(component)
        COMPONENT_HEALTHY.labels(component).set(int(healthy))

    async def set(self, component: str, healthy: bool) -> None:
        """Record a component's health and republish the overall status."""
        if self._components.get(component) != healthy:
            log.info("health component changed", extra={"component": component, "healthy": healthy})
        self._components[component] = healthy
        COMPONENT_HEALTHY.labels(component).set(int(healthy))
        await self._publish()

    @property
    def serving(self) -> bool:
        return not self._shutting_down and all(
            healthy for name, healthy in self._components.items() if name not in self._report_only
        )

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
        status = _status(self.serving)
        for name in self._names:
            await self.servicer.set(name, status)
        for component, healthy in self._components.items():
            await self.servicer.set(component, _status(healthy))


def _status(healthy: bool) -> int:
    serving: int = health_pb2.HealthCheckResponse.SERVING
    not_serving: int = health_pb2.HealthCheckResponse.NOT_SERVING
    return serving if healthy else not_serving


Check = Callable[[], Awaitable[bool]]


class HealthMonitor:
    """Polls named dependency checks and publishes each to the health map.

    A check that returns False, raises or takes longer than ``timeout_s`` marks
    its component unhealthy; a component is unhealthy until its first check
    passes. Start it after registering checks; stop it at shutdown.
    """

    def __init__(self, health: HealthMap, interval_s: float, timeout_s: float) -> None:
        self._health = health
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._checks: dict[str, Check] = {}
        # Runs on every replica: each reports its own health.
        self._checking = BackgroundTasks("health monitor")

    @property
    def health(self) -> HealthMap:
        """The map this monitor publishes to."""
        return self._health

    def add(self, component: str, check: Check, *, readiness: bool = True) -> None:
        """Track ``component`` (unhealthy until its first check passes); see
        :meth:`HealthMap.register` for ``readiness``."""
        self._health.register(component, readiness=readiness)
        self._checks[component] = check

    async def check_all(self) -> None:
        """Run every check once and publish the results."""
        results = await asyncio.gather(*(self._run(check) for check in self._checks.values()))
        for component, healthy in zip(self._checks, results, strict=True):
            await self._health.set(component, healthy)

    async def start(self) -> None:
        await self.check_all()
        self._checking.spawn(self._loop(), name="health-monitor")

    async def stop(self) -> None:
        await self._checking.close()

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.check_all()

    async def _run(self, check: Check) -> bool:
        try:
            async with asyncio.timeout(self._timeout_s):
                return await check()
        except Exception:
            return False
