"""How late the serving event loop runs: a sign of a stalled or CPU-starved
replica that gRPC itself does not give.

grpc.aio takes arrived calls up one per event-loop turn; the others wait inside gRPC,
where neither the RPC metrics nor the dependency guard's stall heartbeat see them. A
timer that asks to run every ``interval_s`` and records how late it ran measures how
long a turn takes to come round: long when the process gets no CPU, something blocks
the loop, or a turn has a burst of work. It is a lower bound on a call's wait, not the
wait: a loop busy with short turns keeps it low while calls queue (measured: 256 in
flight, 1 ms of CPU each, mean lag 0.4-0.8 ms); the call rate against the replica's
ceiling shows that overload.

The monitor is a plain timer callback (``loop.call_at``), not a task: nothing to
cancel but one handle, nothing left if the loop closes first. Each beat schedules the
next from when it ran, so a long stall is one late beat, not a burst catching up.
"""

from __future__ import annotations

import asyncio

from prometheus_client import Histogram

LAG_SECONDS = Histogram(
    "turnstile_event_loop_lag_seconds",
    "How late the serving event loop ran a timer that asked to run every "
    "TURNSTILE_LOOP_LAG_INTERVAL_S: how long one turn of the loop took to come round.",
    buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
)


class LoopLagMonitor:
    """Observes :data:`LAG_SECONDS` every ``interval_s`` on the running loop
    between :meth:`start` and :meth:`stop`."""

    def __init__(self, interval_s: float) -> None:
        if interval_s <= 0:
            raise ValueError("interval_s must be positive")
        self.interval_s = interval_s
        self._observe = LAG_SECONDS.observe
        self._loop: asyncio.AbstractEventLoop | None = None
        self._handle: asyncio.TimerHandle | None = None
        self._due = 0.0

    def is_running(self) -> bool:
        """Whether a beat is pending (between :meth:`start` and :meth:`stop`)."""
        return self._handle is not None

    def start(self) -> None:
        """Begin beating on the running loop (idempotent)."""
        if self._handle is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._schedule(self._loop.time())

    def stop(self) -> None:
        """Cancel the pending beat; none runs after this returns (idempotent)."""
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _schedule(self, now: float) -> None:
        assert self._loop is not None
        self._due = now + self.interval_s
        self._handle = self._loop.call_at(self._due, self._beat)

    def _beat(self) -> None:
        assert self._loop is not None
        now = self._loop.time()
        # The loop may run a timer up to its clock resolution early: never negative.
        self._observe(max(0.0, now - self._due))
        self._schedule(now)
