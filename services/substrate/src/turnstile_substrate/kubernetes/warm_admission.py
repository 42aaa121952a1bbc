"""The warm-pool refill through admission (SPEC W3): each warm pod's creation takes a
cluster-bucket token and a node slot with ``ReserveWarm``, so autosizing cannot take
what real activations need.

Leader-only, as the refill is. Before each warm pod the refill reserves; admission
refuses while activations wait in its fair queue, while the bucket is at the reserve
it keeps for them, or when no candidate node keeps its spare slots: that pod is not
made, and the tier backs off for the retry hint (counted per tier and reason). The hold
is committed once the pod exists and cancelled when the create failed; the pod carries
``turnstile.dev/warm-paid`` so its claim gives the claim's own cluster token back. The
pod's node slot is released (``ReleaseSandbox`` with the pod's name) once the reflector
sees the pod gone, claimed or not; a new leader takes over the paid pods it finds.
A pod that went while no leader watched keeps its slot until admission's committed-slot
backstop (``TURNSTILE_SLOTS__COMMITTED_TTL_S``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Container, Sequence
from typing import Any

from turnstile_platform.errors import RichError
from turnstile_substrate.admission_client import AdmissionClient, WarmHold, WarmRefusedError
from turnstile_substrate.kubernetes import metrics
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.template import ANNOTATION_WARM_PAID

log = logging.getLogger(__name__)


class RefillAdmission:
    """Reservations, back-off and slot releases of one replica's warm-pool refill."""

    def __init__(
        self, admission: AdmissionClient, nodes: Sequence[str], *, unavailable_backoff_s: float
    ) -> None:
        self._admission = admission
        self._nodes = tuple(nodes)
        self._unavailable_backoff_s = unavailable_backoff_s
        #: tier → when its refill may ask again (monotonic)
        self._backoff: dict[str, float] = {}
        #: paid warm pods (claimed or not) → whether the reflector has seen them yet
        self._paid: dict[str, bool] = {}
        self._clock = time.monotonic

    def backing_off(self, tier: str) -> bool:
        return self._backoff.get(tier, 0.0) > self._clock()

    async def reserve(self, tier: str, body: dict[str, Any]) -> WarmHold | None:
        """Reserve ``body``'s creation and mark it paid; None (and the tier backs off)
        when admission refuses or cannot be asked."""
        name = body["metadata"]["name"]
        try:
            hold = await self._admission.reserve_warm(tier, name, self._nodes)
        except WarmRefusedError as refused:
            self._back_off(tier, refused.refused_by, refused.retry_after_s)
            return None
        except RichError as error:
            log.warning("reserving a warm pod of tier %s failed: %s", tier, error.message)
            self._back_off(tier, "unavailable", self._unavailable_backoff_s)
            return None
        body["metadata"].setdefault("annotations", {})[ANNOTATION_WARM_PAID] = "true"
        self._paid[name] = False
        return hold

    async def settle(self, name: str, hold: WarmHold, created: bool) -> None:
        """Commit the hold of a pod made, cancel that of a create that failed."""
        if created:
            await self._admission.commit(hold.hold_id)
            return
        self._paid.pop(name, None)
        await self._admission.cancel(hold.hold_id)

    def take_over(self, index: PodIndex) -> None:
        """A new term: the paid pods the cache shows are this leader's to release."""
        for pod in index.pods.values():
            if pod.paid:
                self._paid.setdefault(pod.name, True)

    async def release_gone(self, index: PodIndex, unseen: Container[str]) -> None:
        """Free the node slots of paid pods the reflector saw go (a failed release is
        tried again on the next pass)."""
        pods = index.pods
        for name, seen in list(self._paid.items()):
            if name in pods:
                self._paid[name] = True
                continue
            if not seen and name in unseen:
                continue  # created, not in the cache yet
            try:
                await self._admission.release_sandbox(name)
            except RichError as error:
                log.info("releasing warm pod %s's slot failed (%s); will retry", name, error)
                continue
            del self._paid[name]

    def _back_off(self, tier: str, reason: str, seconds: float) -> None:
        metrics.WARM_REFILL_REFUSALS.labels(tier=tier, reason=reason).inc()
        self._backoff[tier] = self._clock() + seconds
