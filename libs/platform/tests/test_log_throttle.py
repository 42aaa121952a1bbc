"""The log throttle (SPEC O6): one line per key per interval, "and K more" on the next,
and a bounded table however many keys a caller makes up."""

from __future__ import annotations

import logging

import pytest

from turnstile_platform.log_throttle import LogThrottle

log = logging.getLogger("test.log_throttle")


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.name == log.name]


def test_one_line_per_key_per_interval_and_the_next_line_counts_the_rest(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttle = LogThrottle(log, interval_s=60, clock=clock)
    with caplog.at_level(logging.INFO):
        written = [throttle.warning(("id", "why"), "refused", {"n": i}) for i in range(1000)]
        assert written.count(True) == 1
        assert throttle.warning(("id", "other"), "refused", {})  # another reason: its own line
        clock.now += 60
        assert throttle.warning(("id", "why"), "refused", {"n": "last"})
    lines = _lines(caplog)
    assert len(lines) == 3
    assert lines[0].suppressed_since_last == 0  # type: ignore[attr-defined]
    assert lines[2].getMessage() == "refused (and 999 more since the last such line)"
    assert lines[2].suppressed_since_last == 999  # type: ignore[attr-defined]
    assert lines[2].n == "last"  # type: ignore[attr-defined]


def test_the_table_is_bounded_and_made_up_keys_share_one_overflow_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    throttle = LogThrottle(log, interval_s=60, max_keys=10, clock=clock)
    with caplog.at_level(logging.INFO):
        for i in range(10_000):
            throttle.warning(f"key-{i}", "refused", {})
    assert len(throttle) == 10
    lines = _lines(caplog)
    assert len(lines) == 11  # ten keys, and one line for all the others
    assert getattr(lines[-1], "throttle_overflow", False)

    caplog.clear()
    clock.now += 60  # the tracked keys' intervals are over: new keys take their places
    with caplog.at_level(logging.INFO):
        for i in range(20):
            throttle.warning(f"new-{i}", "refused", {})
    assert len(throttle) == 10
    assert len(_lines(caplog)) == 11
