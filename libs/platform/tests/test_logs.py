"""Both log formats carry the fields a caller passes: JSON as keys, text as key=value."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
from opentelemetry.sdk.trace import TracerProvider

from turnstile_platform import logs
from turnstile_platform.settings import LogFormat


@pytest.fixture
def captured(request: pytest.FixtureRequest) -> Iterator[io.StringIO]:
    fmt: LogFormat = request.param
    stream = io.StringIO()
    root = logging.getLogger()
    saved = root.handlers[:], root.level
    logs.configure_logging("turnstile-test", fmt=fmt)
    root.handlers[0].setStream(stream)  # type: ignore[attr-defined]
    try:
        yield stream
    finally:
        root.handlers[:], level = saved
        root.setLevel(level)


@pytest.mark.parametrize("captured", ["text"], indirect=True)
def test_a_text_line_carries_its_fields_after_the_message(captured: io.StringIO) -> None:
    logging.getLogger("turnstile.test").warning(
        "call refused",
        extra={
            "identity": "spiffe://turnstile.local/client/acme",
            "rpc": "/turnstile.substrate.v1.SubstrateService/Activate",
            "why": "identity may not act for client 'globex'",
            "count": 3,
        },
    )
    line = captured.getvalue().rstrip("\n")
    assert " turnstile-test WARNING turnstile.test: call refused " in line
    assert "identity=spiffe://turnstile.local/client/acme" in line
    assert "rpc=/turnstile.substrate.v1.SubstrateService/Activate" in line
    assert "why=\"identity may not act for client 'globex'\"" in line
    assert line.endswith("count=3")
    assert "\n" not in line


@pytest.mark.parametrize("captured", ["text"], indirect=True)
def test_a_text_line_without_fields_is_the_plain_line(captured: io.StringIO) -> None:
    logging.getLogger("turnstile.test").info("stopped")
    assert captured.getvalue().rstrip("\n").endswith("INFO turnstile.test: stopped")


@pytest.mark.parametrize("captured", ["text"], indirect=True)
def test_a_traceback_stays_below_the_fields_and_quotes_are_escaped(
    captured: io.StringIO,
) -> None:
    try:
        raise ValueError("boom")
    except ValueError:
        logging.getLogger("turnstile.test").exception("failed", extra={"detail": 'a "b"'})
    first, *rest = captured.getvalue().splitlines()
    assert first.endswith('failed detail="a \\"b\\""')
    assert rest[0].startswith("Traceback")


@pytest.mark.parametrize("captured", ["text"], indirect=True)
def test_a_text_line_inside_a_span_carries_the_trace_id(captured: io.StringIO) -> None:
    tracer = TracerProvider().get_tracer("test")
    with tracer.start_as_current_span("call") as span:
        logging.getLogger("turnstile.test").info("inside")
    trace_id = format(span.get_span_context().trace_id, "032x")
    assert captured.getvalue().rstrip("\n").endswith(f"inside trace_id={trace_id}")


@pytest.mark.parametrize("captured", ["json"], indirect=True)
def test_a_json_line_carries_the_same_fields(captured: io.StringIO) -> None:
    logging.getLogger("turnstile.test").warning("call refused", extra={"identity": "x"})
    record = json.loads(captured.getvalue())
    assert record["message"] == "call refused"
    assert record["identity"] == "x"
    assert record["service"] == "turnstile-test"
