"""Bounds on the relay's untrusted ``Attach`` streams (SPEC O6).

Any process in a sandbox pod may open ``Attach`` streams. The relay's stream
limit (SPEC F6) counts attached streams only: a stream takes its slot of the
platform's :class:`~turnstile_platform.call_limits.CallLimits` when its Hello is
accepted (validated, its credential verified), so streams that never say Hello
cannot keep a real worker out. Until then a stream is *waiting*, bounded twice:
it has ``hello_timeout_s`` to be accepted (else ``DEADLINE_EXCEEDED``), and at
most ``max_waiting`` streams wait at once; one more closes the one waiting
longest (``RESOURCE_EXHAUSTED``). A real worker sends its Hello as it opens the
stream and waits milliseconds; silent streams wait until they are pushed out.

An attached stream's heartbeats and credential renewals each draw from a token
bucket of their own. One past its bucket is dropped unanswered: no Redis script,
no signature check, no ack; the stream lives on (ending it would turn the flood
into reconnects, each costing a signature check and two scripts). Drops are
counted and logged, throttled per identity.
"""

from __future__ import annotations

import asyncio
import logging
import time
import weakref
from collections import OrderedDict
from contextvars import ContextVar
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import grpc
import grpc.aio

from turnstile_affinity.metrics import CLOSED_BEFORE_HELLO, DROPPED, WAITING
from turnstile_contracts import affinity_pb2, common_pb2
from turnstile_platform.call_limits import CallKind, CallLimits
from turnstile_platform.errors import RichError, reason_name
from turnstile_platform.identity import peer_identity
from turnstile_platform.log_throttle import LogThrottle

log = logging.getLogger(__name__)

#: The method whose streams take their slot at Hello (``GrpcService(self_admitted_streams=)``).
ATTACH_PATH = "/{}/Attach".format(
    affinity_pb2.DESCRIPTOR.services_by_name["AffinityService"].full_name
)

#: One line per (identity, why) a minute; every event is counted in the metrics.
LINES = LogThrottle(log)

#: The peer identity of the Attach stream being served ("" without one): set as the
#: stream begins, so refusals deep in the stream throttle their lines per identity
#: without every call on the way passing it along.
_IDENTITY: ContextVar[str] = ContextVar("attach_identity", default="")


def stream_identity() -> str:
    """The SPIFFE ID of the Attach stream this task serves ("" if none or plaintext)."""
    return _IDENTITY.get()


class TokenBucket:
    """``burst`` tokens, refilled at ``rate_per_s``; :meth:`take` spends one."""

    __slots__ = ("_burst", "_rate", "_stamp", "_tokens")

    def __init__(self, rate_per_s: float, burst: int) -> None:
        self._rate = rate_per_s
        self._burst = float(burst)
        self._tokens = float(burst)
        self._stamp = time.monotonic()

    def take(self) -> bool:
        now = time.monotonic()
        self._tokens = min(self._burst, self._tokens + (now - self._stamp) * self._rate)
        self._stamp = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True


@dataclass(frozen=True)
class StreamBudgets:
    """How many heartbeats and renewals one stream may send: a rate and a burst each."""

    heartbeats_per_s: float
    heartbeat_burst: int
    renewals_per_s: float
    renewal_burst: int


class AttachLimits:
    """The bounds of one replica's ``Attach`` streams; :meth:`stream` per stream."""

    def __init__(
        self,
        slots: CallLimits,
        *,
        hello_timeout_s: float,
        max_waiting: int,
        budgets: StreamBudgets,
        retry_after_s: float = 1.0,
    ) -> None:
        self._slots = slots
        self.hello_timeout_s = hello_timeout_s
        self.max_waiting = max_waiting
        self.budgets = budgets
        self.retry_after_s = retry_after_s
        #: Streams not yet attached, the one waiting longest first.
        self.waiting: OrderedDict[AttachStream, None] = OrderedDict()
        _LIVE.add(self)

    def stream(self, context: grpc.aio.ServicerContext[Any, Any]) -> AttachStream:
        """The bounds of one stream: ``async with`` around all of it."""
        return AttachStream(self, peer_identity(context) or "")

    def _wait(self, stream: AttachStream) -> None:
        while len(self.waiting) >= self.max_waiting:
            oldest, _ = self.waiting.popitem(last=False)
            oldest.push_out()
        self.waiting[stream] = None

    def _stop_waiting(self, stream: AttachStream) -> None:
        self.waiting.pop(stream, None)

    def _take_slot(self) -> None:
        self._slots.acquire(CallKind.STREAM, "Attach")

    def _free_slot(self) -> None:
        self._slots.release(CallKind.STREAM)


#: Every replica's limits in this process (one in a service; tests start several).
_LIVE: weakref.WeakSet[AttachLimits] = weakref.WeakSet()
WAITING.set_function(lambda: float(sum(len(limits.waiting) for limits in list(_LIVE))))


class AttachStream:
    """One stream's wait for its Hello, its slot once attached, and its budgets.

    Entered when the stream begins: it waits (counted, under the Hello deadline)
    until :meth:`attached`, which takes its slot. Left when the stream ends: the
    slot freed, and a deadline or push-out that ended the wait answered with its
    rich error.
    """

    __slots__ = (
        "_deadline",
        "_heartbeats",
        "_limits",
        "_pushed_out",
        "_renewals",
        "_slot",
        "identity",
    )

    def __init__(self, limits: AttachLimits, identity: str) -> None:
        self._limits = limits
        self.identity = identity
        self._deadline: asyncio.Timeout | None = None
        self._pushed_out = False
        self._slot = False
        budgets = limits.budgets
        self._heartbeats = TokenBucket(budgets.heartbeats_per_s, budgets.heartbeat_burst)
        self._renewals = TokenBucket(budgets.renewals_per_s, budgets.renewal_burst)

    async def __aenter__(self) -> AttachStream:
        _IDENTITY.set(self.identity)
        self._limits._wait(self)
        self._deadline = asyncio.timeout(self._limits.hello_timeout_s)
        await self._deadline.__aenter__()
        return self

    def attached(self) -> None:
        """The stream's Hello was accepted: it stops waiting and takes its slot
        (``RESOURCE_EXHAUSTED`` when the replica holds its limit of streams)."""
        assert self._deadline is not None, "attached() outside the stream's async with"
        self._deadline.reschedule(None)
        if self._pushed_out:
            raise self._closed("pushed_out")
        self._limits._stop_waiting(self)
        self._limits._take_slot()
        self._slot = True

    def heartbeat(self) -> bool:
        """Whether this heartbeat is within the stream's budget (else dropped)."""
        return self._heartbeats.take() or self._dropped("heartbeat")

    def renewal(self) -> bool:
        """Whether this renewal is within the stream's budget (else dropped)."""
        return self._renewals.take() or self._dropped("renewal")

    def push_out(self) -> None:
        """Close this waiting stream now: one more is waiting than may."""
        self._pushed_out = True
        if self._deadline is not None and not self._deadline.expired():
            self._deadline.reschedule(asyncio.get_running_loop().time())

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self._limits._stop_waiting(self)
        if self._slot:
            self._slot = False
            self._limits._free_slot()
        deadline = self._deadline
        if deadline is None:
            return
        try:
            await deadline.__aexit__(kind, error, traceback)
        except TimeoutError:
            raise self._closed("pushed_out" if self._pushed_out else "hello_timeout") from None

    def _dropped(self, kind: str) -> bool:
        DROPPED.labels(kind).inc()
        LINES.warning(
            (self.identity, kind),
            f"worker {kind} past the stream's budget dropped",
            {"identity": self.identity or "-", "kind": kind},
        )
        return False

    def _closed(self, why: str) -> RichError:
        CLOSED_BEFORE_HELLO.labels(why).inc()
        limits = self._limits
        LINES.warning(
            (self.identity, why),
            "attach stream closed before its Hello was accepted",
            {"identity": self.identity or "-", "why": why},
        )
        if why == "pushed_out":
            return RichError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{limits.max_waiting} streams were waiting for their Hello and one more "
                "came; this one waited longest. Send the Hello as the stream opens",
                reason=reason_name(common_pb2.ERROR_REASON_CONCURRENCY_LIMITED),
                metadata={"kind": "waiting_for_hello", "limit": str(limits.max_waiting)},
                retry_after_s=limits.retry_after_s,
            )
        return RichError(
            grpc.StatusCode.DEADLINE_EXCEEDED,
            f"the stream's first message must be a Hello, accepted within "
            f"{limits.hello_timeout_s:g}s",
            reason=reason_name(common_pb2.ERROR_REASON_INVALID_FIELD),
            metadata={"field": "hello", "why": why, "timeout_s": f"{limits.hello_timeout_s:g}"},
            retry_after_s=limits.retry_after_s,
        )
