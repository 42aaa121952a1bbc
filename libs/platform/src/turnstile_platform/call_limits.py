"""Caps on the RPCs a server runs at once: one for unary calls, one for streams
(SPEC F6), each shared by priority levels and flows (SPEC N1).

gRPC's own ``maximum_concurrent_rpcs`` is server-wide: a relay's long-lived
worker streams would use up the slots its unary ``Place`` calls need (and a
burst of ``Place`` would refuse workers). So the bootstrap gives gRPC a backstop
cap above both limits, and enforces the two limits here, in the platform
interceptor, where a refusal can carry the rich error model. Each limit is the
total of its kind's :class:`~turnstile_platform.fair_share.Seats`: the levels'
assured shares add up to it, and a call is seated by its flow's fair share
(:mod:`turnstile_platform.fair_share`, :mod:`turnstile_platform.flows`).

A stream method may take its seat itself instead (``self_admitted``): the
relay's ``Attach`` takes one only when its Hello is accepted, so streams that
never prove themselves cannot keep a real worker out (SPEC O6). Until then its
handler bounds them on its own (a count and a deadline), and gRPC's cap keeps
room for that many. Such a stream takes its seat with :meth:`CallLimits.acquire`
for the flow the interceptor found for it (it waits for none).

Counting is plain integers on the event loop: the server runs every handler on
one loop, so no lock is needed. The gauges read those integers when scraped
rather than being moved on every call (two metric locks per call saved).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from contextvars import ContextVar
from enum import StrEnum

from prometheus_client import Gauge

from turnstile_platform.fair_share import FlowId, Level, Seat, Seats
from turnstile_platform.flows import ANONYMOUS, FlowClassifier
from turnstile_platform.settings import FairShareSettings

#: Room kept in gRPC's server-wide cap for calls the limits do not count
#: (health checks and watches, reflection).
UNCOUNTED_ROOM = 64

IN_FLIGHT = Gauge(
    "turnstile_grpc_server_in_flight",
    "RPCs being served, by kind (unary or stream), against their limit.",
    ["kind"],
)
LEVEL_IN_FLIGHT = Gauge(
    "turnstile_fair_share_in_flight",
    "Calls holding a seat, by kind (unary or stream) and priority level.",
    ["kind", "level"],
)
LEVEL_WAITING = Gauge(
    "turnstile_fair_share_waiting",
    "Calls waiting in their flow's queue for a seat, by kind and priority level.",
    ["kind", "level"],
)
LEVEL_FLOWS = Gauge(
    "turnstile_fair_share_flows",
    "Flows holding or waiting for a seat, by kind and priority level.",
    ["kind", "level"],
)
LEVEL_ASSURED = Gauge(
    "turnstile_fair_share_assured_seats",
    "Seats assured to each priority level, by kind (summed over this process's servers).",
    ["kind", "level"],
)


class CallKind(StrEnum):
    UNARY = "unary"
    STREAM = "stream"


class CallLimits:
    """How many unary calls and how many streams may run at once, shared fairly."""

    def __init__(
        self,
        *,
        unary: int,
        streams: int,
        retry_after_s: float = 1.0,
        self_admitted: Mapping[str, int] | None = None,
        fair_share: FairShareSettings | None = None,
    ) -> None:
        """``self_admitted``: stream methods (full paths) whose handler takes its
        seat with :meth:`acquire` once the stream proves itself, each with how many
        of its streams may be waiting to (kept free in :attr:`server_cap`)."""
        share = fair_share or FairShareSettings()
        self._limits = {CallKind.UNARY: unary, CallKind.STREAM: streams}
        self._self_admitted = dict(self_admitted or {})
        shares = {
            Level.PLATFORM: share.platform_shares,
            Level.TENANTS: share.tenant_shares,
            Level.PLACEMENTS: share.placement_shares,
            Level.WORKERS: share.worker_shares,
        }
        self.seats = {
            kind: Seats(
                kind.value,
                limit,
                shares,
                queue_length=share.queue_length,
                queue_wait_s=share.queue_wait_s,
                retry_after_s=retry_after_s,
            )
            for kind, limit in self._limits.items()
        }
        self.classifier = FlowClassifier(share.roles)
        _LIVE.add(self)

    @property
    def server_cap(self) -> int:
        """gRPC's ``maximum_concurrent_rpcs``: a backstop above both limits, with
        room for the seats levels take back from borrowers (at most each level's
        assured seats past the total) and for self-admitted streams still waiting."""
        seated = sum(
            seats.total + sum(level.assured for level in seats.levels.values())
            for seats in self.seats.values()
        )
        return seated + sum(self._self_admitted.values()) + UNCOUNTED_ROOM

    def admits_itself(self, path: str) -> bool:
        """Whether ``path``'s handler takes its own seat (the interceptor takes none)."""
        return path in self._self_admitted

    def in_flight(self, kind: CallKind) -> int:
        return self.seats[kind].in_flight

    def acquire(self, kind: CallKind, method: str) -> None:
        """Take a seat of ``kind`` for the call being served (its flow as the
        interceptor found it) without waiting; raise the rich refusal when its flow
        may have none. Every acquire that returns is paired with :meth:`release`
        in the same task (a self-admitted stream's handler)."""
        _HELD.set(self.seats[kind].take_now(_FLOW.get(), method))

    def release(self, kind: CallKind) -> None:
        """Give back the seat :meth:`acquire` took."""
        seat = _HELD.get()
        if seat is not None:
            _HELD.set(None)
            self.seats[kind].release(seat)


#: The flow of the stream being served, for a self-admitted handler's :meth:`CallLimits.acquire`.
_FLOW: ContextVar[FlowId] = ContextVar("turnstile_call_flow", default=ANONYMOUS)
_HELD: ContextVar[Seat | None] = ContextVar("turnstile_self_admitted_seat", default=None)


def enter_flow(flow: FlowId) -> None:
    """Set the flow of the stream being served (the interceptor, before its handler)."""
    _FLOW.set(flow)


#: Every server's limits in this process (one in a service; tests start several).
_LIVE: weakref.WeakSet[CallLimits] = weakref.WeakSet()


def _in_flight(kind: CallKind) -> Callable[[], float]:
    def count() -> float:
        return float(sum(limits.in_flight(kind) for limits in list(_LIVE)))

    return count


def _level_reading(kind: CallKind, level: Level, read: str) -> Callable[[], float]:
    def value() -> float:
        return float(sum(getattr(limits.seats[kind], read)(level) for limits in list(_LIVE)))

    return value


for _kind in CallKind:
    IN_FLIGHT.labels(_kind.value).set_function(_in_flight(_kind))
    for _level in Level:
        for _gauge, _read in (
            (LEVEL_IN_FLIGHT, "level_in_flight"),
            (LEVEL_WAITING, "level_waiting"),
            (LEVEL_FLOWS, "level_flows"),
            (LEVEL_ASSURED, "assured"),
        ):
            _gauge.labels(_kind.value, _level.value).set_function(
                _level_reading(_kind, _level, _read)
            )
