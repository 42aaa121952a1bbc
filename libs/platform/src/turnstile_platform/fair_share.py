"""A replica's call seats shared fairly among priority levels and flows (SPEC N1).

In the manner of Kubernetes API Priority and Fairness: a server's seats of one
kind (unary calls, or streams) are its total, split among priority
:class:`Level`\\ s by their shares — each level's *assured* seats are
``ceil(total × share / all shares)``. A call belongs to a level and, within it, to
a :class:`FlowId` (the caller's identity and the client it acts for).

An arriving call of a flow is seated at once when

* its flow holds fewer than its fair share of the level's assured seats
  (assured ÷ the level's active flows, rounded down) — even if other flows hold
  the rest, or other levels borrowed them: those calls give their seats back as
  they end, and no new call is seated past the level's room until they have; or
* there is room and no call of its level waits: the level holds fewer than its
  assured seats, or it borrows the idle room of other levels (the server holds
  fewer than its total).

Otherwise it waits in its flow's own queue (at most ``queue_length`` calls, for
at most ``queue_wait_s``), or is refused ``RESOURCE_EXHAUSTED``
(``CONCURRENCY_LIMITED``, ``RetryInfo``, metadata naming its flow and level). A
freed seat goes to a waiting call of a level under its assured seats first, then
to one that borrows; within a level, to the waiting flow holding fewest seats. So
one flow's flood waits or is refused in its own queue and never costs another
flow a refusal, and a level's assured seats are always there for it. A waiting
call that is cancelled leaves its queue at once. Seats taken back from
borrowers can put the replica past its total for as long as the borrowed calls
run: at most the sum of the assured seats (about the total) more, which the
server's own cap leaves room for (:mod:`turnstile_platform.call_limits`).

State is plain integers on the event loop (one loop serves every handler, so no
lock), per replica; a flow is tracked only while it holds or waits for a seat.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from enum import StrEnum

import grpc
from prometheus_client import Counter

from turnstile_contracts import common_pb2
from turnstile_platform.errors import RichError, reason_name
from turnstile_platform.log_throttle import LogThrottle

log = logging.getLogger(__name__)

#: One "past its fair share" line per (flow, level, reason) a minute; the metrics count every one.
REFUSAL_LOG = LogThrottle(log)

REFUSED = Counter(
    "turnstile_fair_share_refused_total",
    "Calls refused because their flow was past its fair share of its priority level, "
    "by kind, level, reason (queue_full, waited) and the caller's identity as the "
    "policy names it (bounded by the policy: exact identities, prefixes, 'other').",
    ["kind", "level", "reason", "identity"],
)

_CONCURRENCY_LIMITED = reason_name(common_pb2.ERROR_REASON_CONCURRENCY_LIMITED)


class Level(StrEnum):
    """The priority levels, each assured a share of the replica's seats."""

    #: The services' and operators' own calls (identities allowed any client).
    PLATFORM = "platform"
    #: Tenants' control-plane calls (identities scoped to their own clients).
    TENANTS = "tenants"
    #: The gateway's placements.
    PLACEMENTS = "placements"
    #: The workers' streams (the relay's ``Attach``).
    WORKERS = "workers"


@dataclass(frozen=True, slots=True)
class FlowId:
    """Who a call is counted for: its level, the caller's identity ("" without
    one: loopback plaintext) and the client it acts for ("" for none)."""

    level: Level
    identity: str
    client: str = ""
    #: The identity as the policy names it (a metric label of bounded cardinality).
    label: str = "anonymous"

    @property
    def name(self) -> str:
        """The flow as refusals and logs name it."""
        who = self.identity or "anonymous"
        return f"{who} for {self.client}" if self.client else who


class _Flow:
    __slots__ = ("id", "in_flight", "key", "level", "queue")

    def __init__(self, level: _Level, key: tuple[str, str], flow_id: FlowId) -> None:
        self.level = level
        self.key = key
        self.id = flow_id
        self.in_flight = 0
        self.queue: deque[asyncio.Future[None]] = deque()


class _Level:
    __slots__ = ("assured", "flows", "in_flight", "name", "queued", "waiting")

    def __init__(self, name: Level, assured: int) -> None:
        self.name = name
        self.assured = assured
        self.in_flight = 0
        self.waiting = 0
        self.flows: dict[tuple[str, str], _Flow] = {}
        #: Flows with waiting calls (an ordered set).
        self.queued: dict[_Flow, None] = {}


#: A flow's seat, as :meth:`Seats.take` returns it and :meth:`Seats.release` takes it back.
Seat = _Flow


class Seats:
    """One kind's seats (``kind``: ``unary`` or ``stream``) shared by the levels."""

    def __init__(
        self,
        kind: str,
        total: int,
        shares: Mapping[Level, int],
        *,
        queue_length: int,
        queue_wait_s: float,
        retry_after_s: float,
    ) -> None:
        self.kind = kind
        self.total = total
        self.queue_length = queue_length
        self.queue_wait_s = queue_wait_s
        self.retry_after_s = retry_after_s
        self.in_flight = 0
        self.waiting = 0
        all_shares = sum(shares.values())
        self.levels = {
            level: _Level(level, math.ceil(total * share / all_shares))
            for level, share in shares.items()
        }
        self._order = list(self.levels.values())

    def assured(self, level: Level) -> int:
        return self.levels[level].assured

    def level_in_flight(self, level: Level) -> int:
        return self.levels[level].in_flight

    def level_waiting(self, level: Level) -> int:
        return self.levels[level].waiting

    def level_flows(self, level: Level) -> int:
        return len(self.levels[level].flows)

    def try_take(self, flow_id: FlowId) -> Seat | None:
        """A seat for a call of ``flow_id`` if it may have one now (None: it may
        not; the flow stays tracked until :meth:`take` queues or refuses it)."""
        level = self.levels[flow_id.level]
        key = (flow_id.identity, flow_id.client)
        flows = level.flows
        flow = flows.get(key)
        if flow is None:
            flow = flows[key] = _Flow(level, key, flow_id)
        elif flow.queue:
            return None  # its own earlier calls wait: behind them
        if flow.in_flight < level.assured // len(flows) or (
            not level.waiting and (level.in_flight < level.assured or self.in_flight < self.total)
        ):
            flow.in_flight += 1
            level.in_flight += 1
            self.in_flight += 1
            return flow
        return None

    def take_now(self, flow_id: FlowId, method: str) -> Seat:
        """A seat now, or the refusal raised (a caller that cannot wait)."""
        seat = self.try_take(flow_id)
        if seat is None:
            raise self._refuse(flow_id, method, "queue_full")
        return seat

    async def take(self, flow_id: FlowId, method: str) -> Seat:
        """A seat for a call of ``flow_id``, waiting in its flow's queue if need be;
        the refusal raised when the queue is full or the wait ends."""
        seat = self.try_take(flow_id)
        if seat is not None:
            return seat
        level = self.levels[flow_id.level]
        flow = level.flows[(flow_id.identity, flow_id.client)]
        if len(flow.queue) >= self.queue_length or self.queue_wait_s <= 0:
            raise self._refuse(flow_id, method, "queue_full")
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        flow.queue.append(waiter)
        level.queued[flow] = None
        level.waiting += 1
        self.waiting += 1
        try:
            async with asyncio.timeout(self.queue_wait_s):
                await waiter
        except BaseException as error:
            if waiter.done() and not waiter.cancelled():
                # Seated as the wait ended: a timeout keeps the seat, a
                # cancellation gives it back.
                if isinstance(error, TimeoutError):
                    return flow
                self.release(flow)
                raise
            self._leave_queue(flow, waiter)
            if isinstance(error, TimeoutError):
                raise self._refuse(flow_id, method, "waited") from None
            raise
        return flow

    def release(self, seat: Seat) -> None:
        """Give back the seat :meth:`take` (or :meth:`try_take`) gave."""
        level = seat.level
        seat.in_flight -= 1
        level.in_flight -= 1
        self.in_flight -= 1
        if not seat.in_flight and not seat.queue:
            del level.flows[seat.key]
        if self.waiting:
            self._dispatch()

    def _leave_queue(self, flow: _Flow, waiter: asyncio.Future[None]) -> None:
        try:
            flow.queue.remove(waiter)
        except ValueError:
            return  # the dispatcher took it out (and counted it) already
        self._dequeued(flow)
        self._forget_if_idle(flow)

    def _dequeued(self, flow: _Flow) -> None:
        level = flow.level
        level.waiting -= 1
        self.waiting -= 1
        if not flow.queue:
            del level.queued[flow]

    def _forget_if_idle(self, flow: _Flow) -> None:
        if not flow.in_flight and not flow.queue:
            flow.level.flows.pop(flow.key, None)

    def _dispatch(self) -> None:
        """Seat waiting calls while there is room: levels under their assured
        seats first, then those that borrow."""
        for borrow in (False, True):
            for level in self._order:
                while level.queued:
                    flow = min(level.queued, key=_in_flight)
                    fair = level.assured // len(level.flows)
                    room = level.in_flight < level.assured or (
                        borrow and self.in_flight < self.total
                    )
                    if not (flow.in_flight < fair or room):
                        break
                    waiter = flow.queue.popleft()
                    self._dequeued(flow)
                    if waiter.done():
                        continue  # cancelled: its task forgets it
                    flow.in_flight += 1
                    level.in_flight += 1
                    self.in_flight += 1
                    waiter.set_result(None)

    def _refuse(self, flow_id: FlowId, method: str, reason: str) -> RichError:
        level = self.levels[flow_id.level]
        flow = level.flows.get((flow_id.identity, flow_id.client))
        if flow is not None:
            self._forget_if_idle(flow)
        held = flow.in_flight if flow is not None else 0
        REFUSED.labels(self.kind, level.name.value, reason, flow_id.label).inc()
        why = (
            f"its queue of {self.queue_length} is full"
            if reason == "queue_full"
            else f"it waited {self.queue_wait_s:g}s"
        )
        REFUSAL_LOG.warning(
            (flow_id.name, level.name, reason),
            "call refused: its flow is past its fair share",
            {
                "flow": flow_id.name,
                "level": level.name.value,
                "kind": self.kind,
                "reason": reason,
                "rpc": method,
            },
        )
        return RichError(
            grpc.StatusCode.RESOURCE_EXHAUSTED,
            f"flow {flow_id.name} holds {held} of this replica's {self.kind} seats, past its "
            f"fair share of the {level.name.value} level ({level.assured} assured seats among "
            f"{len(level.flows) or 1} flows); {method} was refused as {why}: retry later "
            "or on another replica",
            reason=_CONCURRENCY_LIMITED,
            metadata={
                "kind": self.kind,
                "limit": str(self.total),
                "method": method,
                "level": level.name.value,
                "level_limit": str(level.assured),
                "flow": flow_id.name,
                "why": reason,
            },
            retry_after_s=self.retry_after_s,
        )


def _in_flight(flow: _Flow) -> int:
    return flow.in_flight
