"""The event-loop lag monitor records a stalled loop, and every service runs it
from start until shutdown ends.

The loop really stalls here (``time.sleep`` in a coroutine blocks it, as a
CPU-starved replica's loop is held up), on the real bootstrap serving over a
real socket.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc.aio
import pytest
from prometheus_client import REGISTRY

from turnstile_platform.loop_lag import LoopLagMonitor
from turnstile_platform.server import GrpcService
from turnstile_testing.eventually import eventually
from turnstile_testing.probe import SERVICE, add_probe, call, settings

#: Beats asked for this often: a stall of STALL_S makes one at least
#: STALL_S - INTERVAL_S late, whatever its phase.
INTERVAL_S = 0.02
STALL_S = 0.3
#: The alert's threshold, and a bucket bound of the histogram.
LATE_S = 0.25


def _beats() -> float:
    return REGISTRY.get_sample_value("turnstile_event_loop_lag_seconds_count") or 0.0


def _late_beats() -> float:
    """Beats observed later than ``LATE_S`` (all of them minus the bucket ≤ it)."""
    within = REGISTRY.get_sample_value(
        "turnstile_event_loop_lag_seconds_bucket", {"le": str(LATE_S)}
    )
    return _beats() - (within or 0.0)


async def _stall_loop(seconds: float) -> None:
    time.sleep(seconds)  # noqa: ASYNC251 - blocks the loop: nothing else runs meanwhile


async def _until(condition: Callable[[], bool]) -> None:
    """Let the loop turn until ``condition()`` (the beat after a stall runs on the
    next turn or so; there is no event to await for an observation)."""
    await eventually(condition, timeout_s=10, interval_s=INTERVAL_S, what="a beat observed")


async def test_a_stalled_loop_is_recorded_as_one_late_beat() -> None:
    monitor = LoopLagMonitor(INTERVAL_S)
    monitor.start()
    try:
        late_before = _late_beats()
        await _until(lambda: _beats() > 0)  # beating
        await _stall_loop(2 * STALL_S)
        await _until(lambda: _late_beats() > late_before)
        # One stall is one late beat: the next beat is scheduled from when the late
        # one ran, so none queue up to "catch up" (beats due every interval through
        # the stall would run one after another, the first (2 * STALL_S - LATE_S) /
        # INTERVAL_S of them later than LATE_S). One more is
        # tolerated: this machine is shared and may stall the process on its own.
        beats = _beats()
        await _until(lambda: _beats() >= beats + 3)
        assert 1 <= _late_beats() - late_before <= 2
    finally:
        monitor.stop()
    assert not monitor.is_running()


async def test_every_service_runs_the_monitor_until_it_stops() -> None:
    async def stall(payload: bytes, _: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        await _stall_loop(float(payload.decode()))
        return b"stalled"

    app = GrpcService("probe", settings(loop_lag_interval_s=INTERVAL_S), service_names=[SERVICE])
    add_probe(app, {"Stall": stall})
    assert not app.loop_lag.is_running()  # not before the server starts
    port = await app.start()
    try:
        assert app.loop_lag.is_running()
        late_before = _late_beats()
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            assert await call(channel, "Stall", str(STALL_S).encode()) == b"stalled"
        await _until(lambda: _late_beats() > late_before)
    finally:
        await app.stop()
    assert not app.loop_lag.is_running()
    beats = _beats()
    await asyncio.sleep(5 * INTERVAL_S)  # a stopped monitor observes nothing more
    assert _beats() == beats


def test_the_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        LoopLagMonitor(0)
