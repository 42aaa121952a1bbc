"""OpenTelemetry set-up: one tracer provider per process, OTLP export, gRPC interceptors.

The exporter is configured by the standard ``OTEL_*`` variables (endpoint,
headers, protocol timeouts); ``OTEL_TRACES_EXPORTER=none`` or no endpoint at all
keeps spans in-process. Sampling is parent-based, so a trace started by an
upstream caller is kept or dropped as a whole across services (SPEC X4). Health
and reflection calls are never traced: probes would drown real traffic.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from typing import Any

import grpc.aio
from opentelemetry import trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors, aio_server_interceptor
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler

_UNTRACED_SERVICES = ("grpc.health.v1.", "grpc.reflection.")


def exporter_configured() -> bool:
    """Whether the ``OTEL_*`` environment asks for OTLP export."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(
        os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
        or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    )


def create_tracer_provider(
    service_name: str,
    *,
    processors: Sequence[SpanProcessor] = (),
    sampler: Sampler | None = None,
) -> TracerProvider:
    """A tracer provider for ``service_name``.

    Adds a batching OTLP/gRPC exporter when the environment configures one, plus
    any ``processors`` given (tests pass an in-memory one). The sampler defaults
    to parent-based always-on unless ``OTEL_TRACES_SAMPLER`` says otherwise.
    """
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    if sampler is None and not os.environ.get("OTEL_TRACES_SAMPLER"):
        sampler = ParentBased(ALWAYS_ON)
    provider = TracerProvider(resource=resource, sampler=sampler)
    if exporter_configured():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def _traced() -> Callable[[Any], bool]:
    """Whether a call is traced: everything but health and reflection.

    A plain prefix test rather than the instrumentation's composable filters,
    which cost several runtime Protocol checks on every call of the hot path."""

    def traced(call_details: Any) -> bool:
        method = call_details.method
        if isinstance(method, bytes):
            method = method.decode()
        return not method.lstrip("/").startswith(_UNTRACED_SERVICES)

    return traced


def server_interceptor(provider: trace.TracerProvider) -> grpc.aio.ServerInterceptor[Any, Any]:
    """The grpc.aio server interceptor, skipping health and reflection."""
    interceptor: grpc.aio.ServerInterceptor[Any, Any] = aio_server_interceptor(  # type: ignore[no-untyped-call]
        tracer_provider=provider, filter_=_traced()
    )
    return interceptor


def client_interceptors(provider: trace.TracerProvider) -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors that start client spans and propagate context."""
    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        tracer_provider=provider, filter_=_traced()
    )
    return interceptors
