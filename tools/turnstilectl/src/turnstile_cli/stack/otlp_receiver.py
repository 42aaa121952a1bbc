"""The local stack's trace receiver: OTLP/gRPC in, one JSON line per span out.

Without Docker there is no Jaeger to send spans to, so ``turnstilectl up`` runs
this when no ``jaeger`` binary is on ``PATH`` and ``OTEL_EXPORTER_OTLP_ENDPOINT``
is not set: the standard OTLP ``TraceService`` (OpenTelemetry's own protobufs,
``opentelemetry-proto``; the services export to it with their ordinary exporter),
serving on loopback in a process of its own (``python -m
turnstile_cli.stack.otlp_receiver DIR PORT``): a gRPC server in the runner would
be in every service the runner forks, and gRPC's fork handlers abort such a
child before its ``exec`` (the services died at start with SIGABRT). Each span is appended to
``spans.jsonl`` as the fields ``turnstilectl traces`` draws its trees from; the
file is bounded (:data:`MAX_BYTES`: it then becomes ``spans.1.jsonl`` and a new
one starts, so the last two files' worth is kept) and outlives the stack, so the
last traces can be read after it stopped.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.trace.v1 import trace_pb2

from turnstile_cli.stack import procs

#: The span log, and the one before it once it reached :data:`MAX_BYTES`.
FILE_NAME = "spans.jsonl"
PREVIOUS_NAME = "spans.1.jsonl"
#: How large the span log grows before it is rotated (about 40k spans).
MAX_BYTES = 16 * 1024 * 1024

_STATUS = {
    trace_pb2.Status.STATUS_CODE_UNSET: "UNSET",
    trace_pb2.Status.STATUS_CODE_OK: "OK",
    trace_pb2.Status.STATUS_CODE_ERROR: "ERROR",
}


def span_record(service: str, span: trace_pb2.Span) -> dict[str, Any]:
    """What the span log keeps of one span."""
    return {
        "trace_id": span.trace_id.hex(),
        "span_id": span.span_id.hex(),
        "parent_span_id": span.parent_span_id.hex(),
        "name": span.name,
        "service": service,
        "kind": trace_pb2.Span.SpanKind.Name(span.kind).removeprefix("SPAN_KIND_").lower(),
        "start_ns": span.start_time_unix_nano,
        "end_ns": span.end_time_unix_nano,
        "status": _STATUS.get(span.status.code, "UNSET"),
        "status_message": span.status.message,
    }


def records(request: trace_service_pb2.ExportTraceServiceRequest) -> Iterator[dict[str, Any]]:
    """Every span of an export, with its resource's ``service.name``."""
    for resource_spans in request.resource_spans:
        service = next(
            (
                a.value.string_value
                for a in resource_spans.resource.attributes
                if a.key == "service.name"
            ),
            "",
        )
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                yield span_record(service, span)


class SpanLog:
    """Appends span records to ``directory/spans.jsonl``, rotating at ``max_bytes``."""

    def __init__(self, directory: Path, max_bytes: int = MAX_BYTES) -> None:
        self.path = directory / FILE_NAME
        self.max_bytes = max_bytes

    def append(self, spans: list[dict[str, Any]]) -> None:
        if not spans:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        text = "".join(json.dumps(s, separators=(",", ":")) + "\n" for s in spans)
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            size = 0
        if size and size + len(text) > self.max_bytes:
            self.path.replace(self.path.with_name(PREVIOUS_NAME))
        fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(text)


def read_spans(directory: Path) -> list[dict[str, Any]]:
    """Every span in the span log of ``directory`` (older file first); a line cut
    short by a crash is skipped."""
    spans: list[dict[str, Any]] = []
    for name in (PREVIOUS_NAME, FILE_NAME):
        try:
            lines = (directory / name).read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and isinstance(record.get("trace_id"), str):
                spans.append(record)
    return spans


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, log: SpanLog) -> None:
        self.log = log

    async def Export(  # noqa: N802 - the gRPC method name
        self,
        request: trace_service_pb2.ExportTraceServiceRequest,
        context: grpc.aio.ServicerContext[Any, Any],
    ) -> trace_service_pb2.ExportTraceServiceResponse:
        try:
            self.log.append(list(records(request)))
        except OSError as error:  # a full disk: the exporter sees the failure, the stack runs on
            await context.abort(grpc.StatusCode.UNAVAILABLE, f"span log: {error.strerror}")
        return trace_service_pb2.ExportTraceServiceResponse()


class OtlpReceiver:
    """The OTLP/gRPC trace receiver on ``127.0.0.1:port`` (0: any free port)."""

    def __init__(self, directory: Path, port: int = 0) -> None:
        self.directory = directory
        self.log = SpanLog(directory)
        self.port = port
        self._server: grpc.aio.Server | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self) -> bool:
        """Serve; False when the port cannot be bound."""
        server = grpc.aio.server()
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(  # type: ignore[no-untyped-call]
            _TraceService(self.log), server
        )
        try:
            port = server.add_insecure_port(f"127.0.0.1:{self.port}")
        except RuntimeError:
            return False
        if port == 0:
            return False
        self.port = port
        await server.start()
        self._server = server
        return True

    async def stop(self, grace_s: float = 2.0) -> None:
        if self._server is not None:
            await self._server.stop(grace_s)
            self._server = None


def main(argv: list[str]) -> int:
    """Serve ``argv`` = ``DIR PORT RUNNER_PID`` (port 0: any free port) until SIGTERM
    or SIGINT, and no longer than the runner lives. The first line written is the
    bound port, or 0 when it could not be bound."""
    directory, port, runner = Path(argv[0]), int(argv[1]), int(argv[2])
    # Set here, after exec, not by a preexec_fn in the runner (that would fork it):
    # then the runner may already be gone, so its pid is checked once the signal is set.
    procs.die_with_parent()
    if os.getppid() != runner:
        return 1

    async def serve() -> int:
        receiver = OtlpReceiver(directory, port)
        if not await receiver.start():
            print(0, flush=True)
            return 1
        print(receiver.port, flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for number in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(number, stop.set)
        await stop.wait()
        await receiver.stop()
        return 0

    return asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
