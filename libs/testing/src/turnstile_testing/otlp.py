"""A real OTLP/gRPC trace receiver for tests: the wire format Jaeger ingests.

Services under test export to it through their ordinary OTLP exporter
(``OTEL_EXPORTER_OTLP_ENDPOINT=http://127.0.0.1:PORT``); tests then wait for
the spans they expect instead of sleeping. It runs a threaded (sync) gRPC
server, because the SDK's exporter is synchronous too: an exporter flushing
from the test's event-loop thread must still find a receiver able to answer.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2


@dataclass(frozen=True)
class ReceivedSpan:
    service: str
    name: str
    trace_id: str
    span_id: str
    parent_span_id: str
    kind: int
    attributes: dict[str, object] = field(default_factory=dict)
    #: Wall-clock start and end (ns since the epoch), for stage timings.
    start_ns: int = 0
    end_ns: int = 0


def _value(any_value: common_pb2.AnyValue) -> object:
    kind = any_value.WhichOneof("value")
    return getattr(any_value, kind) if kind else None


class OtlpReceiver(trace_service_pb2_grpc.TraceServiceServicer):
    """Collects exported spans; :meth:`wait_for` waits until a condition holds."""

    def __init__(self) -> None:
        self.spans: list[ReceivedSpan] = []
        self._changed = threading.Condition()
        self._server: grpc.Server | None = None
        self.port = 0

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> OtlpReceiver:
        self._server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self, self._server)  # type: ignore[no-untyped-call]
        self.port = self._server.add_insecure_port("127.0.0.1:0")
        self._server.start()
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.stop(None)

    def Export(  # noqa: N802 - the gRPC method name
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.ServicerContext,
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        received: list[ReceivedSpan] = []
        for resource_spans in request.resource_spans:
            attributes = {a.key: _value(a.value) for a in resource_spans.resource.attributes}
            service = str(attributes.get("service.name", ""))
            for scope_spans in resource_spans.scope_spans:
                for span in scope_spans.spans:
                    received.append(
                        ReceivedSpan(
                            service=service,
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_span_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            attributes={a.key: _value(a.value) for a in span.attributes},
                            start_ns=span.start_time_unix_nano,
                            end_ns=span.end_time_unix_nano,
                        )
                    )
        with self._changed:
            self.spans.extend(received)
            self._changed.notify_all()
        return trace_service_pb2.ExportTraceServiceResponse()

    async def wait_for(
        self, condition: Callable[[list[ReceivedSpan]], bool], timeout: float = 10.0
    ) -> list[ReceivedSpan]:
        """Wait (off the event loop) until ``condition(spans)`` holds; return the spans."""

        def wait() -> list[ReceivedSpan]:
            with self._changed:
                if not self._changed.wait_for(lambda: condition(self.spans), timeout=timeout):
                    raise TimeoutError(f"spans never matched; got {len(self.spans)}")
                return list(self.spans)

        return await asyncio.to_thread(wait)
