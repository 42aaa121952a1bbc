"""One trace crosses service boundaries; spans reach a real OTLP receiver (SPEC X4)."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind

from turnstile_platform.channels import create_channel
from turnstile_platform.server import GrpcService
from turnstile_platform.tracing import create_tracer_provider
from turnstile_testing.otlp import OtlpReceiver
from turnstile_testing.probe import SERVICE, add_probe, call, settings


def _provider(name: str, exporter: InMemorySpanExporter) -> TracerProvider:
    return create_tracer_provider(name, processors=[SimpleSpanProcessor(exporter)])


async def _two_services(
    front_provider: TracerProvider, back_provider: TracerProvider
) -> tuple[GrpcService, GrpcService, grpc.aio.Channel]:
    async def pong(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return b"pong"

    back = GrpcService("back", settings(), service_names=[], tracer_provider=back_provider)
    add_probe(back, {"Pong": pong})
    back_port = await back.start()
    channel = create_channel(
        f"127.0.0.1:{back_port}", SERVICE, timeout_s=5, tracer_provider=front_provider
    )

    async def relay(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return await call(channel, "Pong")

    front = GrpcService("front", settings(), service_names=[], tracer_provider=front_provider)
    add_probe(front, {"Relay": relay})
    await front.start()
    return front, back, channel


async def test_a_call_through_two_services_is_one_trace() -> None:
    front_spans, back_spans = InMemorySpanExporter(), InMemorySpanExporter()
    front, back, channel = await _two_services(
        _provider("front", front_spans), _provider("back", back_spans)
    )
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as client:
            assert await call(client, "Relay") == b"pong"
    finally:
        await channel.close(None)
        await front.stop()
        await back.stop()

    front_server = next(s for s in front_spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    front_client = next(s for s in front_spans.get_finished_spans() if s.kind == SpanKind.CLIENT)
    back_server = next(s for s in back_spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    trace_id = front_server.context.trace_id
    assert front_client.context.trace_id == trace_id
    assert back_server.context.trace_id == trace_id
    assert front_client.parent is not None
    assert front_client.parent.span_id == (front_server.context.span_id)
    assert back_server.parent is not None
    assert back_server.parent.span_id == (front_client.context.span_id)
    assert back_server.resource.attributes["service.name"] == "back"


async def test_a_channel_without_client_spans_still_carries_the_callers_trace() -> None:
    """``client_spans=False`` (turnstilectl with no exporter): no client span, and
    the server's span is a child of the caller's current span all the same."""
    caller_spans, server_spans = InMemorySpanExporter(), InMemorySpanExporter()
    caller = _provider("caller", caller_spans)

    async def pong(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        return b"pong"

    app = GrpcService(
        "back", settings(), service_names=[], tracer_provider=_provider("back", server_spans)
    )
    add_probe(app, {"Pong": pong})
    port = await app.start()
    channel = create_channel(
        f"127.0.0.1:{port}", SERVICE, timeout_s=5, tracer_provider=caller, client_spans=False
    )
    try:
        with caller.get_tracer("test").start_as_current_span("command") as root:
            assert await call(channel, "Pong") == b"pong"
    finally:
        await channel.close(None)
        await app.stop()

    assert [s.kind for s in caller_spans.get_finished_spans()] == [SpanKind.INTERNAL]
    served = next(s for s in server_spans.get_finished_spans() if s.kind == SpanKind.SERVER)
    assert served.context.trace_id == root.get_span_context().trace_id
    assert served.parent is not None
    assert served.parent.span_id == root.get_span_context().span_id


async def test_health_checks_are_not_traced() -> None:
    spans = InMemorySpanExporter()
    app = GrpcService("probe", settings(), service_names=[], tracer_provider=_provider("p", spans))
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            assert response.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await app.stop()
    assert spans.get_finished_spans() == ()


async def test_spans_reach_a_real_otlp_receiver(
    otlp_receiver: OtlpReceiver, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_INSECURE", "true")
    front_provider = create_tracer_provider("turnstile-front")
    back_provider = create_tracer_provider("turnstile-back")
    front, back, channel = await _two_services(front_provider, back_provider)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{front.port}") as client:
            await call(client, "Relay")
    finally:
        await channel.close(None)
        await front.stop()  # stop() flushes the batch processor
        await back.stop()

    spans = await otlp_receiver.wait_for(
        lambda got: {s.service for s in got} >= {"turnstile-front", "turnstile-back"}
    )
    assert len({s.trace_id for s in spans}) == 1
    assert {s.name for s in spans} == {"/test.Probe/Relay", "/test.Probe/Pong"}
