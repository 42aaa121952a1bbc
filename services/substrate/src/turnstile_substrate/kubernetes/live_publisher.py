"""The live publisher: the substrate leader's copy of its reflector's live sandboxes
in Redis, per bounded key, which admission's ``admit.lua`` reads (SPEC S4).

Leader-only work (``run(term)``): one replica writes, fenced by its epoch in every
script (:mod:`turnstile_clientkeys.live_store`), so a deposed leader slow to notice is
refused by Redis itself. Taking over, it drops the ``live-state`` marker, reads what
is published and resyncs in chunks of ``live_counts_chunk`` ids (a 50,000-pod
cluster never blocks Redis for long) before setting the marker; then each change the
index reports moves one sandbox. While the reflector is behind the marker is dropped
(admission counts the pending set alone), and it is renewed every third of its TTL,
so a dead leader's counts lapse. A Redis that lost the epoch refuses the next write
(:class:`~turnstile_clientkeys.live_store.StateLostError`) and the publisher starts
over as a new leader does; without that, empty sets were marked current. Details:
docs/substrate-kubernetes.md (live counts) and docs/admission.md.
"""

from __future__ import annotations

import asyncio
import logging
import time

from turnstile_clientkeys.live_counts import COUNTED
from turnstile_clientkeys.live_store import DROP, KEEP, Change, LiveStore, Op, StateLostError
from turnstile_platform.leader import LeaderTerm
from turnstile_substrate.kubernetes import metrics
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.reflector import Reflector
from turnstile_substrate.live_changes import chunks, diff

log = logging.getLogger(__name__)


class LivePublisher:
    def __init__(
        self, store: LiveStore, index: PodIndex, reflector: Reflector, *, chunk: int
    ) -> None:
        self._store = store
        self._index = index
        self._reflector = reflector
        self._chunk = chunk
        self._renew_s = store.state_ttl_ms / 3000
        self._wake = asyncio.Event()
        self._dirty: set[str] = set()
        #: what Redis holds, as this leader wrote or read it: sandbox id → key
        self.published: dict[str, str] = {}
        self.resyncs = 0

    async def run(self, term: LeaderTerm) -> None:
        """Keep the live sets while this replica leads (cancelled when it stops)."""
        index, reflector = self._index, self._reflector
        index.on_sandbox_change = self._changed
        reflector.on_current_change = self._wake.set
        try:
            while True:
                await self._store.write(term.epoch, state=DROP)
                self.published = await self._store.published(self._chunk)
                log.info(
                    "live publisher: leading at epoch %d, %d ids published",
                    term.epoch,
                    len(self.published),
                )
                try:
                    await self._loop(term)
                except StateLostError:
                    metrics.LIVE_COUNTS_CURRENT.set(0)
                    log.warning("live publisher: Redis lost the live counts; resyncing")
        finally:
            metrics.LIVE_COUNTS_CURRENT.set(0)
            index.on_sandbox_change = None
            reflector.on_current_change = None

    async def _loop(self, term: LeaderTerm) -> None:
        generation = None
        marked = False
        renewed = 0.0
        while True:
            self._wake.clear()
            if not self._reflector.current:
                if marked:
                    await self._store.write(term.epoch, state=DROP, continuing=True)
                    marked = False
                    metrics.LIVE_COUNTS_CURRENT.set(0)
                    log.info("live publisher: reflector behind; counts withdrawn")
                generation = None
                await self._sleep(self._renew_s)
                continue
            self._index.sync_keys()
            if generation != self._index.generation:
                generation = self._index.generation
                self._dirty.clear()
                desired = self._index.live_keys()
                everything = desired.keys() | self.published.keys()
                await self._apply(term, diff(desired, self.published, everything))
                self.resyncs += 1
                metrics.LIVE_COUNTS_RESYNCS.inc()
            while self._dirty:
                dirty, self._dirty = self._dirty, set()
                desired = {}
                for sandbox_id in dirty:
                    key = self._index.live_key(sandbox_id)
                    if key is not None:
                        desired[sandbox_id] = key
                await self._apply(term, diff(desired, self.published, dirty))
            if not self._reflector.current or generation != self._index.generation:
                continue  # fell behind, or re-listed, while writing: start over
            now = time.monotonic()
            if not marked or now - renewed >= self._renew_s:
                await self._store.write(term.epoch, state=COUNTED, continuing=True)
                marked, renewed = True, now
                metrics.LIVE_COUNTS_CURRENT.set(1)
            await self._sleep(max(0.0, self._renew_s - (time.monotonic() - renewed)))

    async def _apply(self, term: LeaderTerm, changes: list[Change]) -> None:
        for chunk in chunks(changes, self._chunk):
            await self._store.write(term.epoch, chunk, KEEP, continuing=True)
            for change in chunk:
                metrics.LIVE_COUNTS_CHANGES.labels(change.op.value).inc()
                if change.op is Op.SET:
                    self.published[change.sandbox_id] = change.key
                elif self.published.get(change.sandbox_id) == change.key:
                    del self.published[change.sandbox_id]

    def wake(self) -> None:
        """Make a pass now (the key set changed: its start re-keys the index)."""
        self._wake.set()

    def _changed(self, sandbox_id: str) -> None:
        self._dirty.add(sandbox_id)
        self._wake.set()

    async def _sleep(self, seconds: float) -> None:
        """Until a change or ``seconds``. A timer sets the wake event rather than an
        ``asyncio.timeout`` that a suppressed TimeoutError would end: on Python 3.11
        a cancellation arriving as the deadline passes can surface as that
        TimeoutError, and leadership ending must always end this work."""
        timer = asyncio.get_running_loop().call_later(seconds, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()
