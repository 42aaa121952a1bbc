"""gRPC channels to other Turnstile services: deadlines, retries, tracing.

Deadlines and retries live in the channel's service config (gRPC's own
mechanism) rather than in hand-written loops: every method gets a default
timeout, and only the methods the caller declares idempotent are retried, on
UNAVAILABLE, with exponential backoff. Client spans propagate the trace context
so one trace crosses service boundaries (SPEC X4).
"""

from __future__ import annotations

import json
from collections.abc import Iterable

import grpc.aio
from opentelemetry import trace

from turnstile_platform import tracing


def service_config(
    service: str,
    *,
    timeout_s: float,
    idempotent_methods: Iterable[str] = (),
    max_attempts: int = 3,
) -> str:
    """The JSON service config: a default deadline, retries for idempotent methods."""
    timeout = f"{timeout_s:.3f}s"
    idempotent = sorted(set(idempotent_methods))
    configs: list[dict[str, object]] = []
    if idempotent:
        configs.append(
            {
                "name": [{"service": service, "method": m} for m in idempotent],
                "timeout": timeout,
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        )
    configs.append({"name": [{"service": service}], "timeout": timeout})
    return json.dumps({"methodConfig": configs})


def create_channel(
    target: str,
    service: str,
    *,
    timeout_s: float,
    idempotent_methods: Iterable[str] = (),
    tracer_provider: trace.TracerProvider | None = None,
    max_message_bytes: int = 4 * 1024 * 1024,
) -> grpc.aio.Channel:
    """An insecure grpc.aio channel to ``target`` for calls to ``service``.

    ``service`` is the full service name (``turnstile.admission.v1.AdmissionService``).
    """
    provider = tracer_provider or trace.get_tracer_provider()
    options = [
        (
            "grpc.service_config",
            service_config(service, timeout_s=timeout_s, idempotent_methods=idempotent_methods),
        ),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
    ]
    return grpc.aio.insecure_channel(
        target, options=options, interceptors=tracing.client_interceptors(provider)
    )
