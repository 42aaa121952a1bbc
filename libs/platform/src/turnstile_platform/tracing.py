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
server's fault. Client spans still come from the instrumentation, imported only
when asked for: it loads ``wrapt`` and ``importlib.metadata``, the larger part of a
short-lived caller's start-up. A caller whose spans go nowhere (``turnstilectl``
with no exporter) asks for propagation alone (:func:`client_interceptors`'s
``spans=False``): the servers still join its trace.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Mapping, Sequence
from contextvars import Token
from typing import Any, cast
from urllib.parse import unquote

import grpc
import grpc.aio
from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.sampling import ALWAYS_ON, ParentBased, Sampler

_UNTRACED_SERVICES = ("grpc.health.v1.", "grpc.reflection.")


def exporter_configured() -> bool:
    """Whether the ``OTEL_*`` environment asks for OTLP export."""
    if os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() == "none":
        return False
    return bool(exporter_endpoint())


#: The longest one export of a short-lived process may take (a command line that
#: exports its spans as it exits): one attempt, no retry. A collector on the same
#: network answers in milliseconds; a missing one must not hold the command up.
SHORT_LIVED_EXPORT_TIMEOUT_S = 0.15

_EXPORTER_LOGGER = "opentelemetry.exporter.otlp.proto.grpc.exporter"


class ExportFailures(logging.Filter):
    """Keeps the OTLP exporter's failure records off stderr and counts them, so a
    short-lived process can say once that its traces went nowhere."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.WARNING:
            self.count += 1
        return False


def exporter_endpoint() -> str:
    """Where the ``OTEL_*`` environment sends traces ("" when nowhere)."""
    return os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


def create_tracer_provider(
    service_name: str,
    *,
    processors: Sequence[SpanProcessor] = (),
    sampler: Sampler | None = None,
    short_lived: bool = False,
) -> TracerProvider:
    """A tracer provider for ``service_name``.

    Adds a batching OTLP/gRPC exporter when the environment configures one, plus
    any ``processors`` given (tests pass an in-memory one). The sampler defaults
    to parent-based always-on unless ``OTEL_TRACES_SAMPLER`` says otherwise.

    ``short_lived``: the process flushes its spans as it exits (``turnstilectl``).
    Its exporter gives up after :data:`SHORT_LIVED_EXPORT_TIMEOUT_S` instead of the
    default 10 s of retries (the SDK's flush ignores its own timeout, so only the
    exporter's bounds it), and the exporter's warnings are held back: see
    :func:`quiet_export_failures`.
    """
    resource = Resource.create({SERVICE_NAME: os.environ.get("OTEL_SERVICE_NAME", service_name)})
    if sampler is None and not os.environ.get("OTEL_TRACES_SAMPLER"):
        sampler = ParentBased(ALWAYS_ON)
    provider = TracerProvider(resource=resource, sampler=sampler)
    if exporter_configured():
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

        exporter = (
            OTLPSpanExporter(timeout=SHORT_LIVED_EXPORT_TIMEOUT_S)
            if short_lived
            else OTLPSpanExporter()
        )
        provider.add_span_processor(BatchSpanProcessor(exporter))
    for processor in processors:
        provider.add_span_processor(processor)
    return provider


def quiet_export_failures() -> ExportFailures:
    """Hold the OTLP exporter's failure lines back (a retry warning and an error
    per attempt, with the gRPC details) and count them instead: a command line's
    user gets one line of its own, not the exporter's."""
    failures = ExportFailures()
    logging.getLogger(_EXPORTER_LOGGER).addFilter(failures)
    return failures


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
        span = self._tracer.start_span(path, parent, trace.SpanKind.SERVER, attributes)
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


def client_interceptors(
    provider: trace.TracerProvider, *, spans: bool = True
) -> list[grpc.aio.ClientInterceptor]:
    """grpc.aio client interceptors that start client spans and propagate context.

    ``spans=False``: propagation only (the current span's context in each call's
    metadata, no client span), for a caller whose spans are exported nowhere."""
    if not spans:
        return [
            cast(grpc.aio.ClientInterceptor, interceptor)
            for interceptor in (_PropagateUnaryUnary(), _PropagateUnaryStream())
        ]
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    interceptors: list[grpc.aio.ClientInterceptor] = aio_client_interceptors(
        tracer_provider=provider, filter_=_traced()
    )
    return interceptors


def _with_context(call_details: grpc.aio.ClientCallDetails) -> grpc.aio.ClientCallDetails:
    """``call_details`` with the current trace context added to its metadata."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    if not carrier:
        return call_details
    metadata = grpc.aio.Metadata(*(call_details.metadata or ()))
    for key, value in carrier.items():
        metadata[key] = value
    return grpc.aio.ClientCallDetails(
        call_details.method,
        call_details.timeout,
        metadata,
        call_details.credentials,
        call_details.wait_for_ready,
    )


class _PropagateUnaryUnary(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_unary(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(_with_context(client_call_details), request)


class _PropagateUnaryStream(grpc.aio.UnaryStreamClientInterceptor):  # type: ignore[type-arg]
    async def intercept_unary_stream(
        self, continuation: Any, client_call_details: grpc.aio.ClientCallDetails, request: Any
    ) -> Any:
        return await continuation(_with_context(client_call_details), request)
