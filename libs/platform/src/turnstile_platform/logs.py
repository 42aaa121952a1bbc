"""Structured logs: one JSON object per line, carrying the current trace and span ids.

A log line written inside a traced RPC can be joined to its trace in Jaeger by
``trace_id``; lines outside any span carry none.
"""

from __future__ import annotations

import logging
import sys
import time

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

from turnstile_platform.settings import LogFormat


class TraceContextFilter(logging.Filter):
    """Adds ``trace_id`` and ``span_id`` (hex) of the active span to every record."""

    def filter(self, record: logging.LogRecord) -> bool:
        context = trace.get_current_span().get_span_context()
        if context.is_valid:
            record.trace_id = format(context.trace_id, "032x")
            record.span_id = format(context.span_id, "016x")
        return True


def configure_logging(service: str, *, level: str = "INFO", fmt: LogFormat = "json") -> None:
    """Send the root logger to stderr in ``fmt``, tagged with ``service``."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(TraceContextFilter())
    if fmt == "json":
        formatter = JsonFormatter(
            "{asctime}{levelname}{name}{message}",
            style="{",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            static_fields={"service": service},
        )
        # RFC 3339 in UTC, so lines from several hosts sort and join.
        formatter.converter = time.gmtime
        formatter.default_time_format = "%Y-%m-%dT%H:%M:%S"
        formatter.default_msec_format = "%s.%03dZ"
        handler.setFormatter(formatter)
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
