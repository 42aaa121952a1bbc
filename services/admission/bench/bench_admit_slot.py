"""What one Redis Cluster slot sustains for admission: ``admit.lua`` against a bare
EVALSHA ceiling, in the same run.

    uv run python services/admission/bench/bench_admit_slot.py [--rounds 3]

Every admission key shares the hash tag ``{adm}`` (the cluster bucket is one key
every decision consumes), so every decision of a deployment runs on one slot:
one Redis master, one thread. ``redis-benchmark`` replays one decision's EVALSHA
exactly as ``AdmissionStore.admit`` sends it (COLD_CREATE, every policy enforced,
two candidate nodes, the live count marked current) against a private
redis-server; limits are high, so every call takes the full admit path (the same
hold and sandbox each call: set sizes stay constant). See docs/scaling.md.
"""

from __future__ import annotations

import redis.asyncio as aioredis

from turnstile_admission.policies import (
    CapSettings,
    ConcurrencySettings,
    PolicyName,
    RateSettings,
)
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs, script_text
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_clientkeys.live_store import LiveStore
from turnstile_testing.slot_bench import SlotLoad, main

PREFIX = "bench:"
HIGH = 1_000_000  # every setting's maximum


async def admit_load(port: int) -> SlotLoad:
    settings = AdmissionSettings(
        redis_prefix=PREFIX,
        cap=CapSettings(default_cap=HIGH),
        rate=RateSettings(
            default_rate_per_s=HIGH, default_burst=HIGH, cluster_rate_per_s=HIGH, cluster_burst=HIGH
        ),
        concurrency=ConcurrencySettings(default_limit=HIGH),
    )
    client = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        store = AdmissionStore(client, settings)
        await LiveStore(client, PREFIX, state_ttl_s=3600).write(1, state=COUNTED)
        modes = dict.fromkeys(PolicyName, 2)
        args = AdmitArgs(
            "hold-1", "acme", "sb-1", modes, nodes=[("node-a", HIGH), ("node-b", HIGH)]
        )
        assert (await store.admit(args)).outcome == "admit"
        keys, argv = store.admit_request(args)
    finally:
        await client.aclose()
    return SlotLoad("admit.lua", script_text("admit.lua"), keys, argv)


if __name__ == "__main__":
    main((__doc__ or "").split("\n")[0], admit_load, f"{PREFIX}{{adm}}:bare")
