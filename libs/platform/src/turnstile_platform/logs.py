"""Structured logs: one JSON object per line, carrying the current trace and span ids.

A log line written inside a traced RPC can be joined to its trace in Jaeger by
``trace_id``; lines outside any span carry none. The text format (the local
stack's) carries the same fields after the message, as ``key=value``, so a
``call refused`` line still says who was refused, for which method and why.
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


#: Attributes every LogRecord has: not fields a caller passed in ``extra``.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {
    "message",
    "asctime",
    "taskName",
    "span_id",  # the trace id is enough to find the trace
}


class TextFormatter(logging.Formatter):
    """``time service LEVEL logger: message key=value ...``: the line a person
    reads, with every field the caller passed (``extra``) and the trace id, in a
    compact form (values with spaces or quotes are quoted)."""

    def __init__(self, service: str) -> None:
        super().__init__(f"%(asctime)s {service} %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        fields = [
            f"{key}={_compact(value)}"
            for key, value in vars(record).items()
            if key not in _STANDARD and not key.startswith("_")
        ]
        if not fields:
            return line
        head, newline, rest = line.partition("\n")  # a traceback stays below the fields
        return f"{head} {' '.join(fields)}{newline}{rest}"


def _compact(value: object) -> str:
    text = str(value)
    if not text or any(c in text for c in ' "=\n'):
        return '"' + text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n") + '"'
    return text


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
        handler.setFormatter(TextFormatter(service))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
