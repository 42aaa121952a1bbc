"""Caps on the RPCs a server runs at once: one for unary calls, one for streams (SPEC F6).

gRPC's own ``maximum_concurrent_rpcs`` is server-wide: a relay's long-lived
worker streams would use up the slots its unary ``Place`` calls need (and a
burst of ``Place`` would refuse workers). So the bootstrap gives gRPC a cap of
both limits plus a little room for health and reflection, and enforces the two
limits here, in the platform interceptor, where a refusal can carry the rich error
model: ``RESOURCE_EXHAUSTED`` with ``ErrorInfo`` (``CONCURRENCY_LIMITED``, which
limit, how large) and ``RetryInfo``.

A stream method may take its slot itself instead (``self_admitted``): the
relay's ``Attach`` takes one only when its Hello is accepted, so streams that
never prove themselves cannot keep a real worker out (SPEC O6). Until then its
handler bounds them on its own (a count and a deadline), and gRPC's cap keeps
room for that many.

Counting is plain integers on the event loop: the server runs every handler on
one loop, so no lock is needed. The in-flight gauge reads those integers when
scraped rather than being moved on every call (two metric locks per call saved).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Mapping
from enum import StrEnum

import grpc
from prometheus_client import Gauge

from turnstile_contracts import common_pb2
from turnstile_platform.errors import RichError, reason_name

#: Room kept in gRPC's server-wide cap for calls the limits do not count
#: (health checks and watches, reflection).
UNCOUNTED_ROOM = 64

IN_FLIGHT = Gauge(
    "turnstile_grpc_server_in_flight",
    "RPCs being served, by kind (unary or stream), against their limit.",
    ["kind"],
)


class CallKind(StrEnum):
    UNARY = "unary"
    STREAM = "stream"


class CallLimits:
    """How many unary calls and how many streams may run at once."""

    def __init__(
        self,
        *,
        unary: int,
        streams: int,
        retry_after_s: float = 1.0,
        self_admitted: Mapping[str, int] | None = None,
    ) -> None:
        """``self_admitted``: stream methods (full paths) whose handler takes its
        slot with :meth:`acquire` once the stream proves itself, each with how many
        of its streams may be waiting to (kept free in :attr:`server_cap`)."""
        self._limits = {CallKind.UNARY: unary, CallKind.STREAM: streams}
        self._self_admitted = dict(self_admitted or {})
        self._in_flight = {CallKind.UNARY: 0, CallKind.STREAM: 0}
        self._retry_after_s = retry_after_s
        _LIVE.add(self)

    @property
    def server_cap(self) -> int:
        """gRPC's ``maximum_concurrent_rpcs``: a backstop above both limits."""
        return sum(self._limits.values()) + sum(self._self_admitted.values()) + UNCOUNTED_ROOM

    def admits_itself(self, path: str) -> bool:
        """Whether ``path``'s handler takes its own slot (the interceptor takes none)."""
        return path in self._self_admitted

    def in_flight(self, kind: CallKind) -> int:
        return self._in_flight[kind]

    def acquire(self, kind: CallKind, method: str) -> None:
        """Take one slot of ``kind`` for a call of ``method``; raise a rich refusal
        when none is free. Every acquire that returns is paired with :meth:`release`.

        (Plain methods rather than a context manager: this runs on every call, and
        the caller's own ``try``/``finally`` costs nothing extra.)"""
        limit = self._limits[kind]
        if self._in_flight[kind] >= limit:
            raise RichError(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"this replica is serving its limit of {limit} concurrent {kind.value} "
                f"RPCs; {method} was refused, retry later or on another replica",
                reason=reason_name(common_pb2.ERROR_REASON_CONCURRENCY_LIMITED),
                metadata={"kind": kind.value, "limit": str(limit), "method": method},
                retry_after_s=self._retry_after_s,
            )
        self._in_flight[kind] += 1

    def release(self, kind: CallKind) -> None:
        """Give back the slot :meth:`acquire` took."""
        self._in_flight[kind] -= 1


#: Every server's limits in this process (one in a service; tests start several).
_LIVE: weakref.WeakSet[CallLimits] = weakref.WeakSet()


def _in_flight(kind: CallKind) -> Callable[[], float]:
    def count() -> float:
        return float(sum(limits.in_flight(kind) for limits in list(_LIVE)))

    return count


for _kind in CallKind:
    IN_FLIGHT.labels(_kind.value).set_function(_in_flight(_kind))
