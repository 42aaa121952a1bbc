"""Concurrent Activates of one sandbox share one activation, and every wait one
call makes on another's work here is bounded per flow (SPEC N2).

The first Activate of a sandbox that is not running becomes the activation's
**leader** (a :class:`Flight`); an Activate of the same sandbox arriving while it
runs on this replica **joins** it (in the manner of Go's ``singleflight``) and
answers from its outcome instead of queueing on the sandbox's lock for its own
turn. Calls waiting on another's work — joiners, and calls waiting for the
in-process lock a Deactivate holds — are counted by :class:`FlowWaits` per flow
(the caller's identity and the client it acts for, as SPEC N1 names flows): past
``activation_waiters_per_flow`` the next is refused at once, so one tenant's
flood of one sandbox holds at most that many of the replica's call slots.
docs/substrate.md ("Concurrent Activates of one sandbox") says who may join and why.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from prometheus_client import Counter, Gauge

from turnstile_clientkeys import Client
from turnstile_platform.metric_children import Children

T = TypeVar("T")

WAITING = Gauge(
    "turnstile_substrate_sandbox_waits",
    "Calls waiting on another call's work on the same sandbox (SPEC N2), by kind"
    " (join: an Activate sharing another's activation; lock: a call waiting for the"
    " sandbox's in-process lock).",
    ["kind"],
)
REFUSED = Counter(
    "turnstile_substrate_sandbox_waits_refused_total",
    "Calls refused instead of waiting on another's work on the same sandbox, by kind"
    " and why (flow_full, timed_out, leader_gone, other_request).",
    ["kind", "why"],
)
_waiting = Children(WAITING)
_refused = Children(REFUSED)


class WaitKind(enum.Enum):
    JOIN = "join"
    LOCK = "lock"


class WaitRefusedError(Exception):
    """A call that may not wait on another's work on ``sandbox_id`` (``why`` says
    which bound), answered ``ABORTED`` / ``SANDBOX_PENDING`` with a retry hint."""

    def __init__(self, sandbox_id: str, kind: WaitKind, why: str, limit: int = 0) -> None:
        super().__init__(f"{sandbox_id}: {kind.value} {why}")
        self.sandbox_id = sandbox_id
        self.kind = kind
        self.why = why
        self.limit = limit
        _refused(kind.value, why).inc()


def flow_of(identity: str, client: Client | None) -> str:
    """A call's flow: who calls and, for a call acting for a client, that client."""
    if client is None:
        return identity
    return f"{identity}|{client.client_id if client.client_id is not None else client.form.value}"


class FlowWaits:
    """How many calls of each flow wait on another's work on this replica's
    sandboxes, at most ``per_flow`` at a time (0: none may wait)."""

    def __init__(self, per_flow: int) -> None:
        self.per_flow = per_flow
        self._waiting: dict[str, int] = {}

    def waiting(self, flow: str) -> int:
        return self._waiting.get(flow, 0)

    def __len__(self) -> int:
        """Flows with a call waiting (the entries this holds: at most one per flow)."""
        return len(self._waiting)

    @contextmanager
    def wait(self, flow: str, sandbox_id: str, kind: WaitKind) -> Iterator[None]:
        """Count one call of ``flow`` waiting for the block, or raise
        :class:`WaitRefusedError` at once when the flow has its ``per_flow`` waiting."""
        count = self._waiting.get(flow, 0)
        if count >= self.per_flow:
            raise WaitRefusedError(sandbox_id, kind, "flow_full", self.per_flow)
        self._waiting[flow] = count + 1
        _waiting(kind.value).inc()
        try:
            yield
        finally:
            _waiting(kind.value).dec()
            left = self._waiting[flow] - 1
            if left:
                self._waiting[flow] = left
            else:
                del self._waiting[flow]


@dataclass(eq=False)
class Flight(Generic[T]):
    """One activation in progress: what it was asked (who may join it) and, once
    done, its answer (a result, or the exception its leader's call ended with)."""

    sandbox_id: str
    #: The client it charges and the tier it asks for (an existing sandbox: its own).
    client: Client
    tier: str
    #: The sandbox's owner as the leader read it before leading (None: no record, or
    #: one naming no client): what a joiner's ownership is checked against.
    recorded: str | None = None
    #: Whether the sandbox has a record (its tier is then the record's, whatever asked).
    restoring: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    result: T | None = None
    error: BaseException | None = None

    def accepts(self, client: Client, tier: str) -> bool:
        """Whether a request may share this activation's answer: one that charges the
        same client for the same tier (another would be decided differently)."""
        return (self.client, self.tier) == (client, tier)

    async def answer(self, timeout_s: float) -> T:
        """The leader's result, or the exception it ended with; waits ``timeout_s`` at
        most (then :class:`WaitRefusedError`). Giving up leaves the leader alone."""
        try:
            async with asyncio.timeout(timeout_s):
                await self.done.wait()
        except TimeoutError:
            raise WaitRefusedError(self.sandbox_id, WaitKind.JOIN, "timed_out") from None
        if self.error is not None:
            raise self.error
        if self.result is None:
            raise WaitRefusedError(self.sandbox_id, WaitKind.JOIN, "leader_gone")
        return self.result


class Flights(Generic[T]):
    """The activations in progress on this replica, by sandbox id (one each)."""

    def __init__(self) -> None:
        self._flights: dict[str, Flight[T]] = {}

    def __len__(self) -> int:
        return len(self._flights)

    def get(self, sandbox_id: str) -> Flight[T] | None:
        return self._flights.get(sandbox_id)

    @contextmanager
    def lead(
        self,
        sandbox_id: str,
        client: Client,
        tier: str,
        recorded: str | None,
        restoring: bool = False,
    ) -> Iterator[Flight[T]]:
        """Register the calling activation as ``sandbox_id``'s flight for the block.
        The block sets ``result``; an exception leaving it is the joiners' answer,
        except a cancellation (the leader's caller left), which they are told of as
        ``leader_gone`` rather than being cancelled themselves."""
        assert sandbox_id not in self._flights, "one flight per sandbox"
        flight: Flight[T] = Flight(sandbox_id, client, tier, recorded, restoring)
        self._flights[sandbox_id] = flight
        try:
            yield flight
        except asyncio.CancelledError:
            raise
        except BaseException as error:
            flight.error = error
            raise
        finally:
            del self._flights[sandbox_id]
            flight.done.set()
