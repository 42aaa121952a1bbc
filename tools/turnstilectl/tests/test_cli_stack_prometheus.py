"""The stack's Prometheus is its own: a Prometheus already on the port is not taken
for it."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from turnstile_cli.stack import prometheus
from turnstile_testing.processes import free_port

BINARY = prometheus.find_binary()
needs_prometheus = pytest.mark.skipif(BINARY is None, reason="Debian's prometheus is not installed")


class _Foreign(BaseHTTPRequestHandler):
    """Answers like a ready Prometheus reading someone else's configuration."""

    def do_GET(self) -> None:
        body = b"Prometheus Server is Ready.\n"
        if self.path.startswith("/api/v1/status/flags"):
            data = {"status": "success", "data": {"config.file": "/elsewhere/prometheus.yml"}}
            body = json.dumps(data).encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return


@pytest.fixture
def foreign_prometheus() -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", free_port()), _Foreign)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


@needs_prometheus
async def test_a_prometheus_already_on_the_port_is_not_taken_for_the_stacks(
    tmp_path: Path, foreign_prometheus: int
) -> None:
    assert BINARY is not None
    local = prometheus.LocalPrometheus(
        directory=tmp_path / "prometheus",
        port=foreign_prometheus,
        metrics_ports=(free_port(), free_port(), free_port()),
        rules=None,
    )
    assert not await local.start(BINARY, timeout_s=15)
    assert local.proc is not None
    assert local.proc.returncode is not None


@needs_prometheus
async def test_the_stacks_own_prometheus_is_recognised(tmp_path: Path) -> None:
    assert BINARY is not None
    local = prometheus.LocalPrometheus(
        directory=tmp_path / "prometheus",
        port=free_port(),
        metrics_ports=(free_port(), free_port(), free_port()),
        rules=None,
    )
    try:
        assert await local.start(BINARY, timeout_s=30)
    finally:
        await local.stop()
