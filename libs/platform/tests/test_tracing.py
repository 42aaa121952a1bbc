"""One trace crosses service boundaries; spans reach a real OTLP receiver (SPEC X4)."""

from __future__ import annotations

import random
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from opentelemetry import propagate, trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased, TraceIdRatioBased
from opentelemetry.trace import SpanKind

from turnstile_platform.channels import create_channel
from turnstile_platform.server import GrpcService
from turnstile_platform.tracing import ServerSpans, create_tracer_provider
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


def _traceparent(trace_id: int, sampled: bool) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{trace_id:032x}-{0xABCDEF:016x}-{'01' if sampled else '00'}"),)


async def test_an_unsampled_call_still_has_its_span_current() -> None:
    """SPEC X4: a dropped span is still current, so what the call makes onward carries
    the trace and its "not sampled" flag; a caller's decision is followed either way."""
    spans = InMemorySpanExporter()
    provider = create_tracer_provider(
        "p", processors=[SimpleSpanProcessor(spans)], sampler=ParentBased(ALWAYS_OFF)
    )
    seen: list[trace.Span] = []

    async def look(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        seen.append(trace.get_current_span())
        return b""

    app = GrpcService("probe", settings(), service_names=[], tracer_provider=provider)
    add_probe(app, {"Look": look})
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            look_call = channel.unary_unary(f"/{SERVICE}/Look", None, None)
            await look_call(b"")
            await look_call(b"", metadata=_traceparent(0x1234, sampled=False))
            await look_call(b"", metadata=_traceparent(0x5678, sampled=True))
    finally:
        await app.stop()

    root, unsampled, sampled = (span.get_span_context() for span in seen)
    assert [type(span) for span in seen[:2]] == [trace.NonRecordingSpan] * 2
    assert root.is_valid
    assert not root.is_remote
    assert not root.trace_flags.sampled
    assert (unsampled.trace_id, unsampled.trace_flags.sampled) == (0x1234, False)
    assert unsampled.span_id != 0xABCDEF
    assert (sampled.trace_id, sampled.trace_flags.sampled) == (0x5678, True)
    finished = spans.get_finished_spans()
    assert [s.name for s in finished] == [f"/{SERVICE}/Look"]
    assert finished[0].parent is not None
    assert finished[0].parent.span_id == 0xABCDEF


class _Context:
    """What ``ServerSpans.start`` reads of a servicer context."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def peer(self) -> str:
        return "ipv4:127.0.0.1:5000"

    def details(self) -> str:
        return ""


@pytest.mark.parametrize("parent", [None, "sampled", "unsampled"])
def test_server_spans_are_the_spans_the_sdk_starts(parent: str | None) -> None:
    """The sampling decision made before the SDK's ``start_span`` gives, from the same
    random state, the same span: ids, flags, trace state, recording or not, and a
    recorded span's attributes (half the traces kept, so both paths run)."""
    exporter = InMemorySpanExporter()
    ours = ServerSpans(
        create_tracer_provider(
            "ours", processors=[SimpleSpanProcessor(exporter)], sampler=TraceIdRatioBased(0.5)
        )
    )
    sdk = create_tracer_provider("sdk", sampler=TraceIdRatioBased(0.5)).get_tracer("sdk")
    attributes = ServerSpans.attributes("test.Probe", "Look")
    recorded = 0
    for seed in range(200):
        metadata = () if parent is None else _traceparent(seed + 1, parent == "sampled")
        carrier = propagate.extract(dict(metadata)) if metadata else None
        random.seed(seed)
        expected = sdk.start_span("/test.Probe/Look", carrier, SpanKind.SERVER, attributes)
        random.seed(seed)
        started = ours.start(_Context(metadata), "/test.Probe/Look", attributes)  # type: ignore[arg-type]
        span = started[0]
        assert span.get_span_context() == expected.get_span_context()
        assert span.is_recording() == expected.is_recording()
        assert type(span) is type(expected)
        ServerSpans.end(started, grpc.StatusCode.OK, _Context(metadata))  # type: ignore[arg-type]
        if expected.is_recording():
            recorded += 1
            got = exporter.get_finished_spans()[-1]
            assert got.context == expected.get_span_context()
            assert dict(got.attributes or {}).items() >= attributes.items()
    assert 0 < recorded < 200 if parent is None else recorded in (0, 200)
