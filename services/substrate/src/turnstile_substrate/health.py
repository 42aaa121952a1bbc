"""The substrate's health components: the substrate itself, PostgreSQL, Redis.

Each is checked every ``health_check_interval_s`` and folded into gRPC health
(:class:`turnstile_platform.health.HealthMap`): any failing component turns the
service NOT_SERVING, so it receives no Activate it could not serve. The
Kubernetes substrate is not ready until its reflector's first list synced.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable

from turnstile_platform.health import HealthMap

log = logging.getLogger(__name__)

Check = Callable[[], Awaitable[bool]]


class HealthMonitor:
    """Polls named checks and publishes each to the health map."""

    def __init__(self, health: HealthMap, interval_s: float, timeout_s: float) -> None:
        self._health = health
        self._interval_s = interval_s
        self._timeout_s = timeout_s
        self._checks: dict[str, Check] = {}
        self._task: asyncio.Task[None] | None = None

    def add(self, component: str, check: Check) -> None:
        """Track ``component`` (unhealthy until its first check passes)."""
        self._health.register(component)
        self._checks[component] = check

    async def check_all(self) -> None:
        """Run every check once and publish the results."""
        results = await asyncio.gather(*(self._run(check) for check in self._checks.values()))
        for component, healthy in zip(self._checks, results, strict=True):
            await self._health.set(component, healthy)

    async def start(self) -> None:
        await self.check_all()
        self._task = asyncio.create_task(self._loop(), name="substrate-health")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

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
