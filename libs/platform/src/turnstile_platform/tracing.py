"""OpenTelemetry set-up: one tracer provider per process, OTLP export, server spans,
client interceptors.

The exporter is configured by the standard ``OTEL_*`` variables (endpoint,
headers, protocol timeouts); ``OTEL_TRACES_EXPORTER=none`` or no endpoint at all
keeps spans in-process. Sampling is parent-based, so a trace started by an
upstream caller is kept or dropped as a whole across services (SPEC X4). Health
and reflection calls are never traced: probes would drown real traffic.

Server spans are started by the platform interceptor through :class:`ServerSpans`
rather than by opentelemetry-instrumentation-grpc's server interceptor, which
(for every call, sampled or not) builds the span's attributes, parses the peer
address, enters two context managers and wraps the servicer context in a
``wrapt`` proxy so it can see ``abort``. Here the sampler decides first and only
a recording span gets the per-call attributes; the call's status comes from the
interceptor, which knows it anyway, so the context is not wrapped. The spans
look the same: name ``/pkg.Service/Method``, kind SERVER, the instrumentation's
``rpc.*`` and ``net.peer.*`` attributes, ERROR status for the codes that are the
server's fault. Client spans still come from the instrumentation.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from contextvars import Token
from typing import Any
from urllib.parse import unquote

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.instrumentation.grpc import aio_client_interceptors
from opentelemetry.sdk import trace as sdk_trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace._tracer_metrics import NoOpTracerMetrics
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler, SamplingResult
from opentelemetry.util.types import Attributes

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
        return traced_service(method.lstrip("/"))

    return traced


def traced_service(service: str) -> bool:
    """Whether calls of ``service`` (``pkg.Service``) get server spans."""
    return not service.startswith(_UNTRACED_SERVICES)


#: The codes a server span is marked ERROR for (the server's fault; as the
#: instrumentation marks them: a refusal of a bad request is not a server error).
_SERVER_ERRORS = frozenset(
    {
        grpc.StatusCode.UNKNOWN,
        grpc.StatusCode.DEADLINE_EXCEEDED,
        grpc.StatusCode.UNIMPLEMENTED,
        grpc.StatusCode.INTERNAL,
        grpc.StatusCode.UNAVAILABLE,
        grpc.StatusCode.DATA_LOSS,
    }
)
_LOOPBACK = ("[::1]", "127.0.0.1")

ServerSpan = tuple[trace.Span, Token[otel_context.Context]]


class ServerSpans:
    """Starts and ends the server span of each traced call (module docstring)."""

    def __init__(self, provider: trace.TracerProvider) -> None:
        self._tracer = provider.get_tracer(__name__)
        self._decided = _Decided.of(self._tracer)

    @staticmethod
    def attributes(service: str, method: str) -> dict[str, Any]:
        """A method's span attributes known before the call (the sampler sees them)."""
        return {
            "rpc.system": "grpc",
            "rpc.grpc.status_code": grpc.StatusCode.OK.value[0],
            "rpc.service": service,
            "rpc.method": method,
        }

    def start(
        self,
        context: grpc.aio.ServicerContext[Any, Any],
        path: str,
        attributes: Mapping[str, Any],
    ) -> ServerSpan:
        """Start the call's span under the caller's trace context, and make it current.

        An unsampled call still gets a (non-recording) span made current, so the
        calls it makes carry the trace and its "not sampled" flag onward."""
        metadata = context.invocation_metadata()
        parent = propagate.extract(dict(metadata)) if metadata else None
        if self._decided is None:
            span = self._tracer.start_span(path, parent, trace.SpanKind.SERVER, attributes)
        else:
            span = self._decided.start(path, parent, attributes)
        if span.is_recording():
            span.set_attributes(_call_attributes(context, metadata or ()))
        return span, otel_context.attach(trace.set_span_in_context(span, parent))

    @staticmethod
    def end(started: ServerSpan, code: object, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        """End the span with the call's status code, and restore the context."""
        span, token = started
        if span.is_recording():
            if isinstance(code, grpc.StatusCode):
                span.set_attribute("rpc.grpc.status_code", code.value[0])
                if code in _SERVER_ERRORS:
                    description = f"{code}:{context.details()}"
                    span.set_status(trace.Status(trace.StatusCode.ERROR, description))
            span.end()
        otel_context.detach(token)


#: A dropped span's flags, without and with the random-trace-id flag (as the SDK sets them).
_UNSAMPLED = (
    trace.TraceFlags(trace.TraceFlags.DEFAULT),
    trace.TraceFlags(trace.TraceFlags.DEFAULT | trace.TraceFlags.RANDOM_TRACE_ID),
)


class _Decided(IdGenerator, Sampler):
    """The sampling decision made before the SDK's ``start_span``, so that a
    dropped span skips it.

    Most calls are not sampled (the production sampler keeps one trace in ten),
    and for them the SDK's ``start_span`` was the largest cost of the platform
    interceptor (docs/performance.md): besides what decides, it looks the parent
    up three times and builds flags, a sampling result's attribute proxy and a
    metrics hook no one reads. Here the server spans' tracer's own sampler and
    id generator decide, in the SDK's order (trace id, decision, span id, so a
    seeded generator gives the same ids); a dropped span is the
    ``NonRecordingSpan`` the SDK would have built. A kept one is still started
    by the SDK, which consults this object as its tracer's sampler and id
    generator: it hands back the trace id and the decision already made, once,
    so the sampler is asked once per span either way.

    Only for an SDK tracer that is enabled and keeps no internal metrics (it
    would count the dropped span); otherwise the SDK starts every span."""

    def __init__(self, tracer: sdk_trace.Tracer) -> None:
        self._tracer = tracer
        self._sampler: Sampler = tracer.sampler
        self._ids: IdGenerator = tracer.id_generator
        self._pending = threading.local()

    @classmethod
    def of(cls, tracer: trace.Tracer) -> _Decided | None:
        """The tracer's decider, installed on it once (the provider keeps one tracer
        per name, so several ``ServerSpans`` of one provider share it)."""
        if not isinstance(tracer, sdk_trace.Tracer):
            return None
        if not isinstance(getattr(tracer, "_tracer_metrics", None), NoOpTracerMetrics):
            return None
        if isinstance(tracer.sampler, cls):
            return tracer.sampler
        decided = cls(tracer)
        tracer.sampler = tracer.id_generator = decided
        return decided

    def start(
        self, path: str, parent: otel_context.Context | None, attributes: Mapping[str, Any]
    ) -> trace.Span:
        """The span ``Tracer.start_span(path, parent, SERVER, attributes)`` starts."""
        tracer = self._tracer
        if not tracer._is_enabled():  # the SDK's own check, before any decision
            return tracer.start_span(path, parent, trace.SpanKind.SERVER, attributes)
        parent_span_context = trace.get_current_span(parent).get_span_context()
        root = not parent_span_context.is_valid
        if root:
            trace_id = self._ids.generate_trace_id()
            random_trace_id = self._ids.is_trace_id_random()
        else:
            trace_id = parent_span_context.trace_id
            random_trace_id = parent_span_context.trace_flags.random_trace_id
        result = self._sampler.should_sample(
            parent, trace_id, path, trace.SpanKind.SERVER, attributes, ()
        )
        if result.decision.is_recording():  # type: ignore[no-untyped-call]
            pending = self._pending
            pending.trace_id, pending.result = (trace_id if root else None), result
            try:
                return tracer.start_span(path, parent, trace.SpanKind.SERVER, attributes)
            finally:
                pending.trace_id = pending.result = None
        span_context = trace.SpanContext(
            trace_id,
            self._ids.generate_span_id(),
            is_remote=False,
            trace_flags=_UNSAMPLED[bool(random_trace_id)],
            trace_state=result.trace_state,
        )
        return trace.NonRecordingSpan(span_context)

    # The SDK's tracer asks these while starting a kept span.

    def generate_trace_id(self) -> int:
        trace_id: int | None = getattr(self._pending, "trace_id", None)
        if trace_id is None:
            return self._ids.generate_trace_id()
        self._pending.trace_id = None
        return trace_id

    def generate_span_id(self) -> int:
        return self._ids.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return self._ids.is_trace_id_random()

    def should_sample(
        self,
        parent_context: otel_context.Context | None,
        trace_id: int,
        name: str,
        kind: trace.SpanKind | None = None,
        attributes: Attributes = None,
        links: Sequence[trace.Link] | None = None,
        trace_state: trace.TraceState | None = None,
    ) -> SamplingResult:
        result: SamplingResult | None = getattr(self._pending, "result", None)
        if result is None:
            return self._sampler.should_sample(
                parent_context, trace_id, name, kind, attributes, links, trace_state
            )
        self._pending.result = None
        return result

    def get_description(self) -> str:
        return self._sampler.get_description()


def _call_attributes(context: grpc.aio.ServicerContext[Any, Any], metadata: Any) -> dict[str, str]:
    """The attributes the instrumentation takes from the call: user agent and peer."""
    out: dict[str, str] = {}
    for key, value in metadata:
        if key == "user-agent":
            out["rpc.user_agent"] = value
    peer = context.peer()  # ipv4:127.0.0.1:57284, ipv6:[::1]:57284, unix:...
    kind, _, address = peer.split(",")[0].partition(":")
    if kind in ("ipv4", "ipv6"):
        ip, _, port = address.rpartition(":")
        ip = unquote(ip)
        out["net.peer.ip"], out["net.peer.port"] = ip, port
        if ip in _LOOPBACK:
            out["net.peer.name"] = "localhost"
    return out


def client_interceptors(provider: trace.TracerProvider) -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors that start client spans and propagate context."""
    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(  # type: ignore[no-untyped-call]
        tracer_provider=provider, filter_=_traced()
    )
    return interceptors
