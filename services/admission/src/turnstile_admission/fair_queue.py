"""The fair queue (SPEC Q1): an Admit with a wait budget that only the cluster
bucket, or only node slots, refuse (or, asked to, only its client's own limits)
waits its turn here instead of being refused.

The queue lives in Redis, in admission's slot (``_queue.lua`` lists its keys), so
it is one queue across every replica. Grants happen inside ``tick.lua``: each
replica runs it every ``queue.tick_interval_s`` from its first waiter until the
queue is empty, and each run
refills the cluster bucket and hands its tokens to the heads of the queue in
weighted-fair order, whichever replica owns them. A waiter costs no Redis work
while it waits and holds no connection: it waits on an ``asyncio.Event`` that its
replica's one tick loop sets when a tick reports it granted; it then decides with
``claim.lua`` (admit.lua on the granted tokens or slot). A slot waiter is granted
by the script that frees a slot on one of its candidate nodes (cancel, release,
a moved commit) or by a tick that finds a slot expired, and woken the same way.
A waiter that gives up (budget ended, caller cancelled) leaves with
``leave.lua``; one whose replica died is swept by another replica's tick (each
entry has an owner and an expiry).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass

from turnstile_admission import metrics
from turnstile_admission.fairness import FairnessGauge
from turnstile_admission.redis_store import AdmissionStore, OwnLimits, Queued
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import Client
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable

log = logging.getLogger(__name__)

#: How much longer than the longest wait the queue's structures live in Redis
#: after their last write: an abandoned queue (every replica gone) vanishes.
_STRUCTURE_GRACE_MS = 60_000

#: How often, at most, a replica asks Redis which of its waiters it lost: one
#: HMGET of all of them, so not on every tick of a long queue.
_LOST_CHECK_INTERVAL_S = 1.0


def waiter_of(client: Client, wait_id: str) -> str:
    """The queue entry id of ``client``'s call that carries ``wait_id``: derived,
    not stored, so GetQueuePosition finds the entry with no index to keep (the
    entry's own owner and expiry are the only ones) and another client's caller,
    deriving from its own client, never finds it (SPEC O1)."""
    tag = f"{client.form.value}\n{client.client_id or ''}\n{wait_id}"
    return "w" + hashlib.sha256(tag.encode()).hexdigest()[:31]


@dataclass
class Wait:
    """One waiter's outcome: granted (claim with ``waiter``) or not."""

    waiter: str
    granted: bool
    queued: Queued | None
    """What joining answered (None: Redis could not be reached to join)."""


class FairQueue:
    """This replica's waiters, and the tick loop that serves them."""

    def __init__(self, store: AdmissionStore, settings: AdmissionSettings) -> None:
        self._store = store
        self._settings = settings.queue
        self._levels = tuple(settings.queue.level_shares)
        #: This replica's id, the owner of its waiters in Redis.
        self.owner = os.urandom(8).hex()
        self._waiters: dict[str, asyncio.Event] = {}
        #: This replica's waiters whose entry is in Redis (their join answered).
        self._joined: set[str] = set()
        #: Joined waiters whose entry Redis lost: woken to join again.
        self._lost: set[str] = set()
        self._tasks = BackgroundTasks("admission fair queue")
        self._ticker: asyncio.Task[None] | None = None
        self._ttl_ms = round((self._settings.max_wait_s + self._settings.claim_ttl_s) * 1000) + (
            _STRUCTURE_GRACE_MS
        )

    @property
    def enabled(self) -> bool:
        return self._settings.max_wait_s > 0

    @property
    def waiting(self) -> int:
        """This replica's waiters."""
        return len(self._waiters)

    async def wait(
        self,
        key: str,
        budget_s: float,
        nodes: Sequence[tuple[str, int]] = (),
        own: OwnLimits | None = None,
        waiter: str = "",
    ) -> Wait:
        """Join ``key``'s queue and wait up to ``budget_s`` for a grant: of the
        cluster bucket's tokens, or with ``nodes`` (candidate nodes and their
        slots) of a slot on one of them, granted by the script that frees it, or
        with ``own`` of room under the key's own limits, FIFO among its waiters.

        Not granted: the waiter has left the queue (or will be swept: it has an
        expiry), holding nothing. Cancelled: it leaves, and the cancellation goes
        on. An entry Redis lost meanwhile (restarted without its data, P6) joins
        again for what is left of the budget, at the back of its key's queue.

        ``waiter``: the entry's id (:func:`waiter_of`), so that its caller can find
        it; random when empty or already waiting, here or on another replica."""
        if not waiter or waiter in self._waiters:
            waiter = os.urandom(16).hex()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + budget_s
        event = asyncio.Event()
        self._waiters[waiter] = event
        first: Queued | None = None
        try:
            while True:
                remaining = deadline - loop.time()
                budget_ms = max(1, round(remaining * 1000))
                try:
                    queued = await self._store.enqueue(
                        waiter, key, self.owner, budget_ms, self._ttl_ms, nodes, own
                    )
                except (DependencyUnavailable, DependencyOverloaded):
                    return Wait(waiter, False, first)
                if queued.taken:
                    # A call on another replica waits under the same wait_id: this
                    # one waits under an id of its own (not findable by that id).
                    del self._waiters[waiter]
                    waiter = os.urandom(16).hex()
                    self._waiters[waiter] = event
                    continue
                first = first or queued
                if not queued.queued:
                    return Wait(waiter, False, first)
                self._joined.add(waiter)
                self._ensure_ticking()
                try:
                    await asyncio.wait_for(event.wait(), remaining)
                except TimeoutError:
                    await self._leave(waiter)
                    return Wait(waiter, False, first)
                except asyncio.CancelledError:
                    # The caller gave up: leave in the background (a grant made
                    # meanwhile goes back); if that fails, the expiry sweeps it.
                    self._tasks.spawn(self._leave(waiter), name="fair queue: leave")
                    raise
                if waiter not in self._lost:
                    return Wait(waiter, True, first)
                self._lost.discard(waiter)
                self._joined.discard(waiter)
                event.clear()
                metrics.QUEUE_REJOINED.inc()
        finally:
            del self._waiters[waiter]
            self._joined.discard(waiter)
            self._lost.discard(waiter)

    async def leave(self, waiter: str) -> None:
        """A granted waiter that will not claim (its caller went) gives its grant back."""
        await self._leave(waiter)

    async def _leave(self, waiter: str) -> None:
        try:
            await self._store.leave(waiter)
        except (DependencyUnavailable, DependencyOverloaded) as error:
            log.warning("fair queue: leave failed; the entry expires", extra={"error": str(error)})

    def _ensure_ticking(self) -> None:
        if self._ticker is None or self._ticker.done():
            self._ticker = self._tasks.spawn(self._tick_loop(), name="fair queue: tick")

    async def _tick_loop(self) -> None:
        """Serve the queue (a BackgroundTasks job that runs on every replica, from
        its first waiter until the queue is empty): one ``tick.lua`` per interval
        grants tokens to the heads of the queue in fair order, for every replica's
        waiters, and wakes this replica's granted ones. It goes on after its own
        waiters are served while the queue still has entries, so a dead replica's
        are swept and its unclaimed grants returned even when no one else waits."""
        interval = self._settings.tick_interval_s
        queued = 1
        failed = False
        checked = -_LOST_CHECK_INTERVAL_S
        while self._waiters or queued:
            try:
                tick = await self._store.tick(self.owner)
            except (DependencyUnavailable, DependencyOverloaded) as error:
                failed = True
                log.warning("fair queue: tick failed", extra={"error": str(error)})
                if not self._waiters:
                    break  # the next waiter starts it again; expiries cover the rest
                await asyncio.sleep(interval)
                continue
            queued = tick.waiters
            metrics.QUEUE_WAITERS.set(tick.waiters)
            for level, length in tick.lengths.items():
                metrics.QUEUE_LENGTH.labels(level).set(length)
            if tick.swept:
                metrics.QUEUE_SWEPT.inc(tick.swept)
            if tick.returned:
                metrics.QUEUE_RETURNED.inc(tick.returned)
            for waiter in tick.granted:
                event = self._waiters.get(waiter)
                if event is not None:
                    event.set()
                else:
                    # Its caller left between the grant and now (its leave may
                    # have run first, or be on its way): give the grant back.
                    self._tasks.spawn(self._leave(waiter), name="fair queue: return grant")
            now = asyncio.get_running_loop().time()
            if (failed or tick.waiters < len(self._joined)) and (
                now - checked >= _LOST_CHECK_INTERVAL_S
            ):
                # Redis was away, or holds fewer entries than this replica's
                # waiters alone: it may have restarted without them (P6).
                checked = now
                failed = not await self._find_lost()
            await asyncio.sleep(interval)
        metrics.QUEUE_WAITERS.set(0)
        for level in self._levels:
            metrics.QUEUE_LENGTH.labels(level).set(0)

    async def _find_lost(self) -> bool:
        """Wake the joined, ungranted waiters whose entry Redis no longer has, so
        they join again; False when Redis could not be asked."""
        waiting = [w for w in self._joined if not self._waiters[w].is_set()]
        if not waiting:
            return True
        try:
            present = await self._store.queued(waiting)
        except (DependencyUnavailable, DependencyOverloaded):
            return False
        for waiter, there in zip(waiting, present, strict=True):
            event = self._waiters.get(waiter)  # it may have left meanwhile
            if not there and event is not None and not event.is_set():
                self._lost.add(waiter)
                event.set()
        return True

    def watch_fairness(self) -> None:
        """Keep the fairness gauge up to date (every replica: see ``fairness.py``)."""
        gauge = FairnessGauge(self._store, self._levels, self._settings.fairness_interval_s)
        self._tasks.supervise(gauge.run, name="fair queue: fairness", forever=True)

    async def close(self) -> None:
        await self._tasks.close()
