"""LoopStalls measures the time the event loop could not run, and only that."""

from __future__ import annotations

import time

from turnstile_testing.stalls import LoopStalls


async def test_a_blocked_loop_is_measured_within_the_interval_it_blocked() -> None:
    async with LoopStalls() as stalls:
        await stalls.caught_up()
        before = time.perf_counter()
        await stalls.caught_up()
        started = time.perf_counter()
        time.sleep(0.3)  # noqa: ASYNC251 - the stall being measured
        await stalls.caught_up()
        ended = time.perf_counter()
    assert 0.25 <= stalls.within(started, ended) <= ended - started
    # Nothing of it falls before the interval it blocked.
    assert stalls.within(before - 1, before) == 0.0
