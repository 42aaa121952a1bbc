"""Leader-only work of a substrate that cannot count its sandboxes (Direct): keep
the live-state marker saying so (the store is
:class:`turnstile_clientkeys.live_store.LiveStore`, shared with admission's tests).
"""

from __future__ import annotations

import asyncio

from turnstile_clientkeys.live_counts import UNSUPPORTED
from turnstile_clientkeys.live_store import LiveStore
from turnstile_platform.leader import LeaderTerm


async def declare_unsupported(store: LiveStore, term: LeaderTerm) -> None:
    """Leader-only work of a substrate that cannot count (Direct): keep the marker
    saying so, so the cap answers UNKNOWN(UNSUPPORTED) and admits (SPEC S4). When
    it lapses (the substrate is down) the count is merely unavailable and the cap
    decides on the pending set alone."""
    interval = store.state_ttl_ms / 3000
    while True:
        await store.write(term.epoch, state=UNSUPPORTED)
        await asyncio.sleep(interval)
