"""The warm pool (SPEC S6): pre-created pods per tier, claimed by an optimistic label patch.

**Claims.** A claim reserves the oldest claimable warm pod of its tier (so two
claims in one replica never race for the same pod), then adopts it with a
label patch carrying the resourceVersion the reflector saw. Of two replicas
claiming one pod, the API server applies one patch and answers 409 to the other.

**A failed adoption invalidates the pod, whatever the failure.** The pod is
marked *spent* — this replica never offers it again — and discarded: deleted,
unless it now demonstrably belongs to another claim (it carries another claim's
token: that claimer won the race and the pod is its sandbox now). It is never
returned to the pool: a returned pod would be first in line again, and a
refusal that repeats (an admission webhook, a quota on the pod) would fail
every later claim. A discard that fails is retried by the refill loop.

**Templates.** Every warm pod carries the hash of the template that made it
(``turnstile.dev/template``). Only pods made from the tier's current template are
claimed or counted as available; the refill deletes the others and makes current ones,
so a change of a tier's runtime (another RuntimeClass, other resources, another image)
never hands out a pod of the old one.

**Refill.** Leader-only work (:meth:`WarmPool.run`, registered on the replica's
leader elector): only the leader keeps each tier at its configured size, so a
scale-up is not filled once per replica (a pod storm). With admission, each warm
pod's creation is reserved first (:mod:`.warm_admission`, SPEC W3). ``available = warm pods
the reflector sees − reserved − spent + created but not yet seen``; claims
happen on every replica, and the leader sees them through its reflector. The
excess is trimmed (the highest names first) with a resourceVersion precondition
so a pod adopted meanwhile is left alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
import random
import secrets
import time
from collections.abc import Iterator
from typing import Any

from turnstile_platform.background import BackgroundTasks
from turnstile_platform.leader import LeaderTerm
from turnstile_substrate.admission_client import WarmHold
from turnstile_substrate.kubernetes import metrics, template
from turnstile_substrate.kubernetes.api import KubeApiError, PodsApi
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.podinfo import PodInfo
from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.kubernetes.warm_admission import RefillAdmission
from turnstile_substrate.kubernetes.warm_sizing import PoolSizer, SizingPolicy
from turnstile_substrate.passes import log_failed_pass
from turnstile_substrate.runtime import LABEL_SANDBOX_ID, RuntimeSpec

log = logging.getLogger(__name__)

#: Annotation the adoption patch writes: which claim won the pod.
ANNOTATION_CLAIM = "turnstile.dev/claim"

#: How long a created warm pod is counted before the reflector shows it; after
#: that it is assumed gone (deleted before it was ever seen).
_UNSEEN_TTL_S = 60.0


class AdoptionFailedError(Exception):
    """A warm pod could not be adopted; it has been invalidated."""

    def __init__(self, pod: str, reason: str, cause: BaseException) -> None:
        super().__init__(f"adopting warm pod {pod} failed ({reason}): {cause}")
        self.pod = pod
        self.reason = reason


class WarmPool:
    """Claims and refills warm pods; one per substrate replica."""

    def __init__(
        self,
        api: PodsApi,
        index: PodIndex,
        settings: KubernetesSettings,
        synced: asyncio.Event,
        *,
        credentials: bool = False,
        admission: RefillAdmission | None = None,
    ) -> None:
        """``credentials``: warm pods mount a (not yet existing) credential Secret.
        ``admission``: each warm pod's creation is reserved through admission first
        (SPEC W3); None creates them bounded by the tiers' sizes alone."""
        self._api = api
        self._admission = admission
        self._credentials = credentials
        self._index = index
        self._settings = settings
        self._synced = synced
        #: reserved by an in-flight claim of this replica
        self._claiming: set[str] = set()
        #: adopted or invalidated here: never offered again (until the reflector drops it)
        self._spent: set[str] = set()
        #: invalidated pods whose discard has not succeeded yet → the claim token tried
        self._discard_pending: dict[str, str] = {}
        #: created here, not yet seen by the reflector → (tier, deadline)
        self._unseen: dict[str, tuple[str, float]] = {}
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._stopped = False
        # Leader only (the warm pool is leader work): the clean-ups of its refills.
        self._cleanups = BackgroundTasks("warm pool clean-ups")
        #: each tier's template hash (settings are frozen: computed once per tier)
        self._templates: dict[str, str] = {}
        #: autosized tiers' sizers (fed on every replica, so a new leader starts warm)
        self._sizers: dict[str, PoolSizer] = {}
        #: warm pods this replica created and has not yet seen Running → created at
        self._born: dict[str, float] = {}
        #: when the last refill pass integrated idle warm pod-seconds
        self._idle_at: float | None = None
        self._clock = time.monotonic

    # ------------------------------------------------------------------ lifecycle

    async def run(self, term: LeaderTerm) -> None:
        """The refill loop, while this replica leads (cancelled when it stops leading)."""
        if self._stopped:
            await asyncio.Event().wait()  # stopped for good: idle until cancelled
        log.info("warm pool refill starts (leader epoch %d)", term.epoch)
        self._task = asyncio.current_task()
        try:
            await self._run()
        finally:
            self._task = None

    async def stop(self) -> None:
        """Stop refilling for good (the loop, if running, is cancelled) and finish clean-ups."""
        self._stopped = True
        task, self._task = self._task, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self._cleanups.wait()

    def sizer(self, tier: str) -> PoolSizer | None:
        """``tier``'s autosizer, or None when its size is static."""
        runtime = self._settings.tier_runtime(tier)
        if not runtime.warm_autosize:
            return None
        found = self._sizers.get(tier)
        if found is None:
            found = PoolSizer(
                SizingPolicy(
                    min_size=runtime.warm_min,
                    max_size=runtime.warm_max,
                    headroom=runtime.warm_headroom,
                )
            )
            self._sizers[tier] = found
        return found

    def record_demand(self, tier: str, hit: bool) -> None:
        """A sandbox pod appeared in ``tier``: a warm pod adopted (hit) or a cold create."""
        runtime = self._settings.tier_runtime(tier)
        if not (runtime.warm_autosize or runtime.warm_pool_size):
            return
        sizer = self.sizer(tier)
        if sizer is not None:
            sizer.record_demand(self._clock())
            if not hit:
                self.wake()  # a miss: grow now, not at the next interval
        if self._task is not None:
            metrics.WARM_DEMAND.labels(tier=tier, result="hit" if hit else "miss").inc()

    def target_size(self, tier: str) -> int:
        """The size the refill keeps ``tier`` at now (and the sizing gauges)."""
        sizer = self.sizer(tier)
        if sizer is None:
            return self._settings.warm_size(tier)
        sizing = sizer.size(self._clock())
        gauge = metrics.WARM_POOL
        gauge.labels(tier=tier, term="demand").set(sizing.demand)
        gauge.labels(tier=tier, term="forecast").set(sizing.forecast)
        gauge.labels(tier=tier, term="ready_seconds").set(sizing.ready_s)
        gauge.labels(tier=tier, term="target").set(sizing.target)
        return sizing.target

    def wake(self) -> None:
        """Ask the refill loop to look again now (a claim, a warm pod came or went)."""
        self._wake.set()

    # ------------------------------------------------------------------ claims

    def template(self, tier: str) -> str:
        """The hash of ``tier``'s current template (what its warm pods must carry)."""
        found = self._templates.get(tier)
        if found is None:
            found = template.template_hash(self._settings, tier, credentials=self._credentials)
            self._templates[tier] = found
        return found

    def _candidates(self, tier: str) -> Iterator[PodInfo]:
        """Claimable pods of ``tier``, oldest first (lazily)."""
        require_running = self._settings.warm_require_running
        current = self.template(tier)
        return (
            pod
            for pod in self._index.warm(tier)
            if pod.template == current
            and pod.name not in self._claiming
            and pod.name not in self._spent
            and (not require_running or pod.phase == "Running")
        )

    def claimable(self, tier: str) -> PodInfo | None:
        """Whether a claim in ``tier`` has a pod to try: the oldest, if any."""
        return next(self._candidates(tier), None)

    def reserve(self, tier: str) -> PodInfo | None:
        """Reserve a claimable pod of ``tier`` for one claim, chosen at random among the
        oldest few: replicas claiming at once then mostly try different pods instead of
        all racing for the oldest (the losers would each discard it, SPEC S6)."""
        spread = self._settings.warm_claim_spread
        candidates = list(itertools.islice(self._candidates(tier), spread))
        if not candidates:
            return None
        pod = random.choice(candidates)
        self._claiming.add(pod.name)
        return pod

    def release(self, pod: PodInfo) -> None:
        """Give back a reservation that was never tried (the cap gate refused first)."""
        self._claiming.discard(pod.name)

    def skip(self, pod: PodInfo) -> None:
        """Give up a reservation another claim is taking (its credential Secret is there
        first): never offered here again, and left to that claim."""
        self._claiming.discard(pod.name)
        self._spent.add(pod.name)

    async def adopt(self, pod: PodInfo, spec: RuntimeSpec) -> PodInfo:
        """Adopt a reserved pod for ``spec``; on any failure invalidate it and raise
        :class:`AdoptionFailedError`."""
        token = secrets.token_hex(8)
        body = template.adoption_patch(spec, pod.resource_version)
        body["metadata"]["annotations"] = {ANNOTATION_CLAIM: token}
        try:
            adopted = await self._api.patch(pod.name, body)
        except BaseException as error:
            reason = _reason(error)
            self._spent.add(pod.name)
            self._claiming.discard(pod.name)
            metrics.WARM_CLAIMS.labels(tier=spec.tier, result="failed").inc()
            metrics.WARM_INVALIDATIONS.labels(tier=spec.tier, reason=reason).inc()
            log.info("warm pod %s invalidated after a failed adoption (%s)", pod.name, reason)
            self._discard_pending[pod.name] = token
            await self._cleanups.shielded(self._discard(pod.name))
            self.wake()
            if isinstance(error, Exception):
                raise AdoptionFailedError(pod.name, reason, error) from error
            raise
        self._spent.add(pod.name)
        self._claiming.discard(pod.name)
        metrics.WARM_CLAIMS.labels(tier=spec.tier, result="adopted").inc()
        self.wake()
        return adopted

    async def _discard(self, name: str) -> None:
        """Delete an invalidated pod unless another claim now owns it; never raises."""
        token = self._discard_pending.get(name)
        if token is None:
            return
        try:
            for _ in range(3):
                current = await self._api.read(name)
                if current is None or _owned_by_other_claim(current, token):
                    break
                meta = current["metadata"]
                try:
                    await self._api.delete(
                        name, uid=meta.get("uid"), resource_version=meta.get("resourceVersion")
                    )
                    break
                except KubeApiError as error:
                    if not error.conflict:
                        raise
                    # changed between read and delete: look again
            else:
                return  # kept changing; the refill loop tries again
        except Exception as error:
            log.warning("discarding warm pod %s failed (%s); will retry", name, error)
            return
        self._discard_pending.pop(name, None)

    # ------------------------------------------------------------------ refill

    def available(self, tier: str) -> int:
        """Warm pods of ``tier`` that are or will be claimable (Pending ones included)."""
        current = self.template(tier)
        count = sum(
            1
            for pod in self._index.warm(tier)
            if pod.template == current
            and pod.name not in self._claiming
            and pod.name not in self._spent
        )
        return count + sum(1 for t, _ in self._unseen.values() if t == tier)

    async def reconcile(self) -> None:
        """One refill pass: prune bookkeeping, retry discards, fill or trim every tier."""
        self._prune()
        for name in list(self._discard_pending):
            await self._discard(name)
        if self._admission is not None:
            await self._admission.release_gone(self._index, self._unseen)
        tiers = set(self._settings.warm_tiers()) | set(self._index.warm_tiers())
        now = self._clock()
        since, self._idle_at = self._idle_at, now
        for tier in sorted(tiers):
            self._observe(tier, now, 0.0 if since is None else now - since)
            await self._replace_stale(tier)
            size = self.target_size(tier)
            have = self.available(tier)
            metrics.WARM_POOL.labels(tier=tier, term="size").set(have)
            if have < size:
                await self._fill(tier, size - have)
            elif have > size:
                await self._trim(tier, have - size)

    def _observe(self, tier: str, now: float, elapsed: float) -> None:
        """Feed the ready times of this replica's new warm pods that are Running now, and
        count the pod-seconds ready warm pods sat unclaimed since the last pass."""
        sizer = self.sizer(tier)
        ready = 0
        for pod in self._index.warm(tier):
            if pod.phase != "Running":
                continue
            ready += 1
            born = self._born.pop(pod.name, None)
            if born is not None and sizer is not None:
                sizer.record_ready(now - born)
        if elapsed > 0 and ready:
            metrics.WARM_IDLE_SECONDS.labels(tier=tier).inc(ready * elapsed)

    async def _fill(self, tier: str, missing: int) -> None:
        """Create ``missing`` warm pods of ``tier`` at once, each reserved through
        admission first when the refill goes through it (a tier backing off after a
        refusal makes none)."""
        admission = self._admission
        if admission is not None and admission.backing_off(tier):
            return
        await asyncio.gather(*(self._reserve_and_create(tier) for _ in range(missing)))

    async def _reserve_and_create(self, tier: str) -> None:
        body = template.warm_pod(self._settings, tier, credentials=self._credentials)
        hold = None
        if self._admission is not None:
            hold = await self._admission.reserve(tier, body)
            if hold is None:
                return
        await self._create(tier, body, hold)

    async def _create(self, tier: str, body: dict[str, Any], hold: WarmHold | None) -> None:
        name = body["metadata"]["name"]
        self._unseen[name] = (tier, time.monotonic() + _UNSEEN_TTL_S)
        self._born[name] = self._clock()
        created = False
        try:
            await self._api.create(body)
            created = True
        except Exception as error:
            self._unseen.pop(name, None)
            log.warning("creating a warm pod in tier %s failed: %s", tier, error)
        finally:
            if hold is not None and self._admission is not None:
                settle = self._admission.settle(name, hold, created)
                await self._cleanups.shielded(settle)
        if created:
            metrics.WARM_CREATED.labels(tier=tier).inc()

    async def _trim(self, tier: str, excess: int) -> None:
        current = self.template(tier)
        candidates = sorted(
            (
                pod
                for pod in self._index.warm(tier)
                if pod.template == current
                and pod.name not in self._claiming
                and pod.name not in self._spent
            ),
            key=lambda pod: pod.name,
        )
        for pod in candidates[-excess:]:
            await self._remove(pod, "trimming")

    async def _replace_stale(self, tier: str) -> None:
        """Delete the tier's unclaimed warm pods made from another template (the refill
        then makes current ones)."""
        current = self.template(tier)
        stale = [
            pod
            for pod in self._index.warm(tier)
            if pod.template != current
            and pod.name not in self._claiming
            and pod.name not in self._spent
        ]
        for pod in stale:
            if await self._remove(pod, "replacing stale"):
                metrics.WARM_INVALIDATIONS.labels(tier=tier, reason="stale_template").inc()

    async def _remove(self, pod: PodInfo, why: str) -> bool:
        """Delete an unclaimed warm pod as the cache saw it; False when it changed since."""
        try:
            await self._api.delete(pod.name, uid=pod.uid, resource_version=pod.resource_version)
        except KubeApiError as error:
            # 409: adopted or changed since the reflector saw it; look again next pass
            log.info("%s warm pod %s skipped: %s", why, pod.name, error)
            return False
        self._spent.add(pod.name)
        return True

    def _prune(self) -> None:
        pods = self._index.pods
        now = time.monotonic()
        self._spent = {
            name for name in self._spent if (pod := pods.get(name)) is not None and pod.is_warm
        }
        self._unseen = {
            name: (tier, deadline)
            for name, (tier, deadline) in self._unseen.items()
            if name not in pods and deadline > now
        }
        self._born = {
            name: born
            for name, born in self._born.items()
            if name in self._unseen or ((pod := pods.get(name)) is not None and pod.is_warm)
        }

    async def _run(self) -> None:
        await self._synced.wait()
        if self._admission is not None:
            self._admission.take_over(self._index)
        interval = self._settings.warm_pool_interval_s
        while True:
            self._wake.clear()
            try:
                await self.reconcile()
            except asyncio.CancelledError:
                raise
            except Exception as error:
                log_failed_pass(log, "warm-pool refill", error)
            # asyncio.timeout, not wait_for: on 3.11 wait_for may swallow a cancellation
            # that races with the event, and stop() would then wait forever
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(interval):
                    await self._wake.wait()


def _reason(error: BaseException) -> str:
    if isinstance(error, KubeApiError):
        if error.conflict:
            return "conflict"
        if error.not_found:
            return "not_found"
    return "error"


def _owned_by_other_claim(pod: dict[str, Any], token: str) -> bool:
    """The pod was adopted by a claim other than ours (so it is that sandbox's now)."""
    meta = pod.get("metadata") or {}
    labels = meta.get("labels") or {}
    claim = (meta.get("annotations") or {}).get(ANNOTATION_CLAIM)
    return LABEL_SANDBOX_ID in labels and claim != token
