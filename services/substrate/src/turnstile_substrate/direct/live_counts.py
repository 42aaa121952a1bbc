"""The live counts of the Direct substrate (SPEC S4), published as the Kubernetes
leader publishes its reflector's.

Direct knows its runtimes exactly: each one's record (pid, start time, client
label) is in its sandbox's directory, and the substrate starts and stops every
one. ``TURNSTILE_DIRECT_LIVE_COUNTS`` says what it tells admission:

* ``count`` (the local stack's): :class:`DirectLiveCounts` publishes each live
  runtime under its client's bounded key (moving it out of the key's pending set,
  as the Kubernetes publisher does), so the cap applies on Direct too;
* ``unsupported`` (the default): :func:`declare_unsupported` keeps the marker
  saying this substrate cannot count, so the cap answers UNKNOWN(UNSUPPORTED)
  and admits.

Both are leader-only work (Direct is always its own leader: one host). The store
is :class:`turnstile_clientkeys.live_store.LiveStore`, shared with admission's
tests; every write is fenced by the term's epoch.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping

from turnstile_clientkeys import Resolver
from turnstile_clientkeys.live_counts import COUNTED, UNSUPPORTED
from turnstile_clientkeys.live_store import DROP, KEEP, LiveStore, StateLostError
from turnstile_platform.leader import LeaderTerm
from turnstile_substrate.live_changes import chunks, diff
from turnstile_substrate.runtime import LiveCount

log = logging.getLogger(__name__)

#: Every live runtime's sandbox id and client label (None: unattributed).
Snapshot = Callable[[], Mapping[str, str | None]]


async def declare_unsupported(store: LiveStore, term: LeaderTerm) -> None:
    """Leader-only work of a Direct substrate that does not count: keep the marker
    saying so, so the cap answers UNKNOWN(UNSUPPORTED) and admits (SPEC S4). When
    it lapses (the substrate is down) the count is merely unavailable and the cap
    decides on the pending set alone."""
    interval = store.state_ttl_ms / 3000
    while True:
        await store.write(term.epoch, state=UNSUPPORTED)
        await asyncio.sleep(interval)


class DirectLiveCounts:
    """The Direct substrate's live runtimes, by bounded key, kept in Redis.

    The substrate calls :meth:`changed` when it starts or stops a runtime; the
    publisher then re-reads the runtimes (``snapshot``) and writes what differs.
    It re-reads on every renewal of the marker too (a third of its ttl), which
    catches a runtime that died by itself."""

    def __init__(self, snapshot: Snapshot, resolver: Resolver, *, chunk: int) -> None:
        self._snapshot = snapshot
        self._resolver = resolver
        self._chunk = chunk
        self._wake = asyncio.Event()
        #: The latest snapshot, by sandbox id → bounded key (for :meth:`count`).
        self.live: dict[str, str] = {}
        #: What Redis holds, as this leader wrote or read it: sandbox id → key.
        self.published: dict[str, str] = {}

    def changed(self) -> None:
        """A runtime started or stopped: publish soon."""
        self._wake.set()

    def count(
        self, key: str, exclude_sandbox_id: str | None, pending: Collection[str]
    ) -> LiveCount:
        """The key's other live runtimes, and which of ``pending`` are among them, as
        of the latest snapshot."""
        others = {s for s, k in self.live.items() if k == key and s != exclude_sandbox_id}
        return LiveCount(len(others), frozenset(s for s in pending if s in others))

    def read(self) -> dict[str, str]:
        """Every live runtime now, by sandbox id → its client's bounded key."""
        resolve = self._resolver.resolve_label
        self.live = {sandbox: resolve(label).key for sandbox, label in self._snapshot().items()}
        return self.live

    async def run(self, store: LiveStore, term: LeaderTerm) -> None:
        """Keep the live sets while this process leads (cancelled when it stops)."""
        while True:
            await store.write(term.epoch, state=DROP)
            self.published = await store.published(self._chunk)
            try:
                await self._loop(store, term)
            except StateLostError:
                log.warning("direct live counts: Redis lost them; resyncing")

    async def _loop(self, store: LiveStore, term: LeaderTerm) -> None:
        renew_s = store.state_ttl_ms / 3000
        while True:
            self._wake.clear()
            desired = await asyncio.to_thread(self.read)
            changes = diff(desired, self.published, desired.keys() | self.published.keys())
            for chunk in chunks(changes, self._chunk):
                await store.write(term.epoch, chunk, KEEP, continuing=True)
            self.published = dict(desired)
            await store.write(term.epoch, state=COUNTED, continuing=True)
            await self._sleep(renew_s)

    async def _sleep(self, seconds: float) -> None:
        """Until a change or ``seconds`` (a timer sets the event, as the Kubernetes
        publisher's does, so a cancellation always ends this work)."""
        timer = asyncio.get_running_loop().call_later(seconds, self._wake.set)
        try:
            await self._wake.wait()
        finally:
            timer.cancel()
