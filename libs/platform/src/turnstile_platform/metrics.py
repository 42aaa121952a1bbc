"""The Prometheus ``/metrics`` endpoint.

Metric label values that name a client are always bounded keys from the
resolver (SPEC C3): cardinality is bounded by the key set, never by callers.
"""

from __future__ import annotations

import logging
from wsgiref.simple_server import WSGIServer

from prometheus_client import start_http_server

log = logging.getLogger(__name__)


class MetricsEndpoint:
    """A background HTTP server for the default registry; :meth:`close` stops it."""

    def __init__(self, host: str, port: int) -> None:
        self._server: WSGIServer | None = None
        self.port = 0
        if port:
            server, _thread = start_http_server(port, addr=host)
            self._server = server
            self.port = server.server_port
            log.info("metrics endpoint listening", extra={"address": f"{host}:{self.port}"})

    async def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
