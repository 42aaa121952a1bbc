"""The event loop's stalls during a timed test, so a bound on a call's latency
can leave out the time the loop could not run at all.

A guarded call's budget counts only the time its event loop could run
(``turnstile_platform.bounded``): on a machine whose other processes take the
CPU for half a second, a call that waits out its budget is answered half a
second later, by design. A test that bounds such a call's latency and runs the
service on its own loop measures those stalls here, with a heartbeat of its own,
and subtracts the part that fell inside the call: the bound then still catches a
guard that waits too long on a quiet loop, and no longer fails because the
machine was busy.

The guard measures stalls too (``bounded._Stalls``), and the service's loop-lag
monitor (``turnstile_platform.loop_lag``) how late its loop runs; a test that
judges the guard's latency does not take the guard's own measure of what to
excuse, so this heartbeat is the test's.
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType

from turnstile_platform.background import BackgroundTasks


class LoopStalls:
    """A heartbeat on the running loop every ``beat_s``; a beat at least
    ``stall_s`` late marks the interval it was late for as a stall.

    Use as ``async with LoopStalls() as stalls:``, then :meth:`within`. Times are
    :func:`time.perf_counter` seconds, as the tests take them."""

    def __init__(self, beat_s: float = 0.01, stall_s: float = 0.05) -> None:
        self.beat_s = beat_s
        self.stall_s = stall_s
        #: (start, end) of each stall seen so far.
        self.stalls: list[tuple[float, float]] = []
        self._beating = BackgroundTasks("loop stall detector")
        self._beaten = asyncio.Event()

    async def __aenter__(self) -> LoopStalls:
        self._beating.spawn(self._beat(), name="heartbeat")
        return self

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self._beating.close()

    async def _beat(self) -> None:
        due = time.perf_counter() + self.beat_s
        while True:
            await asyncio.sleep(self.beat_s)  # a heartbeat: the wait is the measurement
            now = time.perf_counter()
            if now - due >= self.stall_s:
                self.stalls.append((due, now))
            due = now + self.beat_s
            self._beaten.set()
            self._beaten.clear()

    async def caught_up(self) -> None:
        """Return once a beat has fired after this call: a stall that was under way
        (its beat overdue, not yet fired) is then recorded."""
        await self._beaten.wait()

    def within(self, started: float, ended: float) -> float:
        """Seconds of stalls that fell between ``started`` and ``ended``."""
        return sum(max(0.0, min(end, ended) - max(start, started)) for start, end in self.stalls)
