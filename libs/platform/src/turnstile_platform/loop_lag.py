"""How late the serving event loop runs: a sign of a stalled or CPU-starved
replica that gRPC itself does not give.

grpc.aio takes arrived calls up one at a time, each on a turn of the event loop;
the others wait inside gRPC before any handler runs
(:func:`turnstile_platform.server.connection_options`), where neither the RPC
metrics (they start with the handler) nor the dependency guard's stall
heartbeat (:mod:`turnstile_platform.bounded`, alive only while a Redis or
PostgreSQL call is in flight) can see them. A timer that asks to run every
``interval_s`` and records how late it ran measures how long one turn takes to
come round: long when the process gets no CPU (a node's other load, CPU-limit
throttling), when something blocks the loop, or when a turn has a burst of work.

It is a lower bound on a waiting call's wait, not that wait: a call waits one
turn for each call taken up before it, the timer one turn. A loop that is
merely busy with short turns keeps the lag low while calls queue in gRPC
(measured: 256 calls in flight on a replica whose handler burns 1 ms of CPU,
mean lag 0.4-0.8 ms, none over 10 ms); the call rate against the replica's
ceiling shows that overload, not this.

The monitor is a plain timer callback (``loop.call_at``), not a task: there is
no coroutine to wake, nothing to cancel but one handle, and nothing left behind
if the loop closes first. Each beat schedules the next from when it ran, not
from when it was due, so a long stall is one late beat, not a burst of beats
catching up. The histogram has no labels: Prometheus adds ``job`` and
``instance``, and lag is a property of one replica.
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
