"""A failed periodic pass logs an outage as one line and a bug with its traceback."""

from __future__ import annotations

import logging

import pytest

from turnstile_platform.bounded import BreakerOpenError
from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable
from turnstile_substrate.passes import log_failed_pass

log = logging.getLogger("turnstile_substrate.test_passes")


@pytest.mark.parametrize(
    "error",
    [
        ConnectionRefusedError(111, "Connect call failed"),
        DependencyUnavailable("postgresql", "postgresql unavailable: connection was closed"),
        BreakerOpenError("postgresql", "the postgresql breaker is open"),
        DependencyOverloaded("redis", "held up here past the overload wait"),
    ],
    ids=["refused", "dropped", "breaker", "overloaded"],
)
def test_an_outage_is_one_warning_line(caplog: pytest.LogCaptureFixture, error: Exception) -> None:
    with caplog.at_level(logging.WARNING, logger=log.name):
        log_failed_pass(log, "sweep pass", error)
    (record,) = caplog.records
    assert record.levelno == logging.WARNING
    assert record.exc_info is None
    assert "next pass retries" in record.getMessage()


def test_anything_else_keeps_its_traceback(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger=log.name):
        log_failed_pass(log, "sweep pass", KeyError("name"))
    (record,) = caplog.records
    assert record.levelno == logging.ERROR
    assert record.exc_info is not None
