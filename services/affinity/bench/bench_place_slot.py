"""What one Redis Cluster slot sustains for affinity: ``place.lua`` (a turn that
hits its session's sandbox) against a bare EVALSHA ceiling, in the same run.

    uv run python services/affinity/bench/bench_place_slot.py [--rounds 3]

Every affinity key shares the hash tag ``{affinity}`` (a placement picks a
sandbox and then touches its keys, so they must share the session's slot; see
docs/scaling.md), so every ``Place`` of a deployment runs on one slot: one Redis
master, one thread. ``redis-benchmark`` replays one hit's EVALSHA exactly as
``AffinityStore.place`` sends it, against a private redis-server: prune (nothing
expired), the record, presence, a lease taken, the load index updated (the same
lease each call: set sizes stay constant).
"""

from __future__ import annotations

import redis.asyncio as aioredis

from turnstile_affinity.store import AffinityStore, Leased, Turn, script_text
from turnstile_testing.slot_bench import SlotLoad, main

PREFIX = "bench:"
TTL_MS = 3_600_000


async def place_load(port: int) -> SlotLoad:
    client = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        store = AffinityStore(client, PREFIX)
        for sandbox in ("sb-1", "sb-2", "sb-3"):
            status, _ = await store.attach(
                sandbox_id=sandbox,
                owner=f"owner-{sandbox}",
                tier="a",
                capacity=1_000_000,
                labels={"turnstile.dev/tier": "a"},
                endpoint="",
                presence_ttl_ms=TTL_MS,
                generation="",
                client="acme",
            )
            assert status == "ok"
        turn = Turn("session-1", "a", True, "lease-1", TTL_MS, TTL_MS, "acme", False)
        assert isinstance(await store.claim(turn), Leased)
        assert isinstance(await store.place(turn, grace_ms=60_000), Leased)
        keys, argv = store.place_request(turn, grace_ms=60_000)
    finally:
        await client.aclose()
    return SlotLoad("place.lua (hit)", script_text("place"), keys, argv)


if __name__ == "__main__":
    main((__doc__ or "").split("\n")[0], place_load, f"{PREFIX}{{affinity}}:bare")
