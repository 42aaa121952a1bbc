"""Reservations for the substrate's warm-pool refill (SPEC W3, ``ReserveWarm``).

A warm pod is charged to no client, but creating it costs what a cold create
costs: a cluster-bucket token and, when candidate nodes are named, a node slot.
``reserve_warm.lua`` takes both as a hold owned by the pod, settled like an
activation's (CommitHold, CancelHold, ReleaseSandbox with the pod's name), and
only while real activations keep what they need (docs/admission.md, "Warm-pool
reservations"). A refusal is data here; the handler makes it the error.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
from prometheus_client import Counter

from turnstile_admission.orphans import OrphanedHolds
from turnstile_admission.policies import SlotsSettings
from turnstile_admission.redis_store import AdmissionStore, WarmAnswer
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import common_pb2
from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable
from turnstile_platform.errors import RichError, reason_name

WARM_RESERVATIONS = Counter(
    "turnstile_admission_warm_reservations_total",
    "ReserveWarm calls of the warm-pool refill, by result: reserved, or what refused "
    "(queue: activations wait in the fair queue; cluster_bucket: the bucket is at its "
    "reserve for activations; node_slots: no candidate node keeps its spare slots).",
    ["result"],
)
for _result in ("reserved", "queue", "cluster_bucket", "node_slots"):
    WARM_RESERVATIONS.labels(_result)


@dataclass(frozen=True)
class WarmReservation:
    """What ``ReserveWarm`` answers: a hold, or why not and when to retry."""

    reserved: bool
    hold_id: str
    hold_expires_ms: int
    node: str
    cluster_tokens: float
    #: ``queue``, ``cluster bucket`` or ``node slots`` when refused.
    refused_by: str = ""
    retry_after_s: float = 0.0


class WarmReservations:
    """Runs ``reserve_warm.lua`` and turns its answer into a :class:`WarmReservation`."""

    def __init__(
        self, settings: AdmissionSettings, store: AdmissionStore, orphans: OrphanedHolds
    ) -> None:
        self._settings = settings
        self._slots: SlotsSettings = settings.slots
        self._store = store
        self._orphans = orphans

    async def reserve(self, hold_id: str, pod: str, nodes: Sequence[str]) -> WarmReservation:
        capacities = [(node, self._slots.capacity(node)) for node in nodes]
        try:
            answer = await self._store.reserve_warm(hold_id, pod, capacities)
        except (DependencyOverloaded, DependencyUnavailable, asyncio.CancelledError):
            # The script may have run for a caller that is gone, or its reply was
            # lost: nobody will settle its hold, so cancel it once Redis answers
            # (its tombstone stops a script still on its way).
            self._orphans.cancel(hold_id)
            raise
        if answer.outcome == "reserved":
            WARM_RESERVATIONS.labels("reserved").inc()
            return WarmReservation(
                True, hold_id, answer.hold_expires_ms, answer.node, answer.cluster_tokens
            )
        refused_by = answer.refused_by or "cancelled"
        if answer.outcome == "refused":
            WARM_RESERVATIONS.labels(refused_by.replace(" ", "_")).inc()
        return WarmReservation(
            False,
            "",
            0,
            "",
            answer.cluster_tokens,
            refused_by,
            self._retry_after_s(answer),
        )

    def _retry_after_s(self, answer: WarmAnswer) -> float:
        """The script's hint (the bucket back above its reserve, the first slot
        held to expire), capped like the slot policy's; else the setting's."""
        fallback = self._settings.warm.retry_after_s
        if answer.retry_ms < 0:
            return fallback
        seconds = answer.retry_ms / 1000
        if answer.refused_by == "node slots":
            seconds = min(seconds, self._slots.retry_after_s)
        return max(seconds, 0.001)


#: The ErrorInfo reason of a refusal, by what refused.
_REASONS = {
    "node slots": common_pb2.ERROR_REASON_NODE_SLOTS_EXHAUSTED,
    "cluster bucket": common_pb2.ERROR_REASON_RATE_LIMITED,
    "queue": common_pb2.ERROR_REASON_RATE_LIMITED,
}
_WHY = {
    "queue": "activations are waiting in the fair queue: the cluster bucket is theirs",
    "cluster bucket": "the cluster bucket is down to the reserve kept for activations",
    "node slots": "no candidate node would keep its spare slots for cold creates "
    "(or its slots have activations waiting)",
}


def refusal(reservation: WarmReservation, tier: str, pod: str) -> RichError:
    """A refused reservation as ``ReserveWarm``'s error: RESOURCE_EXHAUSTED with
    ErrorInfo (what refused, the bucket's tokens) and RetryInfo."""
    why = reservation.refused_by
    return RichError(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        message=f"warm pod {pod} of tier {tier} not reserved: {_WHY.get(why, why)}",
        reason=reason_name(_REASONS.get(why, common_pb2.ERROR_REASON_RATE_LIMITED)),
        metadata={
            "refused_by": why.replace(" ", "_"),
            "tier": tier,
            "cluster_tokens": f"{reservation.cluster_tokens:.3f}",
        },
        retry_after_s=reservation.retry_after_s,
    )
