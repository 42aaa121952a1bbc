"""The real admission service in the test's own process, on a real socket and the
test's Redis: the one place the service, CLI and cross-service tests start it.

The only module of the kit that imports a service (an import contract keeps it so):
the rest of the kit stays below the services it tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from opentelemetry.sdk.trace import TracerProvider

from turnstile_admission.app import create_app
from turnstile_admission.settings import AdmissionSettings
from turnstile_platform.server import GrpcService


def admission_settings(redis_url: str, redis_prefix: str, /, **overrides: Any) -> AdmissionSettings:
    """A test's admission settings: loopback, free ports (gRPC and metrics), the test's
    Redis and key prefix, no shutdown grace, text logs; plaintext, as the kit's plugin
    sets it. ``overrides`` (limits, allowlist, queue, another Redis...) win."""
    return AdmissionSettings.model_validate(
        {
            "host": "127.0.0.1",
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "port": 0,
            "metrics_port": 0,
            "shutdown_grace_s": 0,
            "log_format": "text",
            **overrides,
        }
    )


@asynccontextmanager
async def running_admission(
    settings: AdmissionSettings, *, tracer_provider: TracerProvider | None = None
) -> AsyncIterator[GrpcService]:
    """The admission service started with ``settings`` (its port: ``app.port``),
    stopped on leaving."""
    app = await create_app(settings, tracer_provider=tracer_provider)
    await app.start()
    try:
        yield app
    finally:
        await app.stop()
