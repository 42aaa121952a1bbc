"""What admitting the warm-pool refill costs (SPEC W3): the time to fill a pool, direct
against through admission's ``ReserveWarm``, in one run.

    uv run python services/substrate/bench/bench_warm_refill.py [--pods 40] [--rounds 5]

Each round starts a fresh API-server emulator (API only: pods are stored, not started)
and a Kubernetes substrate whose one tier wants ``--pods`` warm pods, and times from the
substrate's first synced list to its reflector seeing them all. The modes alternate
within a round: ``direct`` (the refill bounded by the tier's size alone) and
``admitted`` (each pod reserved first, a real admission service on the local Redis
with a bucket and node slots too large to refuse, then its hold committed). Reported:
each mode's median fill time over the rounds, their ratio, the added time per pod, and
the load average. Redis: ``TURNSTILE_TEST_REDIS_URL`` or ``redis://127.0.0.1:6379/0``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import statistics
import time

from turnstile_admission.app import create_app as create_admission
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import KeySet, Resolver
from turnstile_platform import peers
from turnstile_substrate.admission_client import AdmissionClient
from turnstile_substrate.kubernetes import KubernetesSettings, KubernetesSubstrate
from turnstile_substrate.kubernetes.tier_runtime import TierRuntime
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator import KubeEmulator

NS = "sandboxes"
TIER = "bench"


async def fill_seconds(pods: int, admission: AdmissionClient | None) -> float:
    async with KubeEmulator(bookmark_interval=0.05) as kube:
        settings = KubernetesSettings(
            api_host=kube.url,
            namespace=NS,
            nodes=("node-a", "node-b"),
            warm_require_running=False,
            warm_pool_interval_s=0.05,
            tier_runtimes={TIER: TierRuntime(warm_pool_size=pods)},
        )
        sub = KubernetesSubstrate(
            settings, Resolver(KeySet(version=1, allowlist=frozenset())), admission=admission
        )
        await sub.start()
        try:
            await sub.wait_synced(10)
            start = time.perf_counter()
            await sub.reflector.wait_until(
                lambda: sum(1 for _ in sub.index.warm(TIER)) >= pods, timeout=120
            )
            return time.perf_counter() - start
        finally:
            await sub.close()


async def main(pods: int, rounds: int) -> None:
    redis_url = os.environ.get("TURNSTILE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    loopback = {"host": "127.0.0.1", "plaintext": True}
    app = await create_admission(
        AdmissionSettings.model_validate(
            {
                **loopback,
                "redis_url": redis_url,
                "redis_prefix": f"bench-warm-{secrets.token_hex(4)}:",
                "port": 0,
                "metrics_port": 0,
                "log_format": "text",
                "rate": {"cluster_burst": 1_000_000, "cluster_rate_per_s": 1_000_000},
                "slots": {"default_per_node": 100_000},
            }
        )
    )
    port = await app.start()
    client = AdmissionClient(
        peers.admission(
            SubstrateSettings.model_validate({**loopback, "admission_addr": f"127.0.0.1:{port}"}),
            None,
        ),
        retry_after_s=1.0,
        timeout_s=5.0,
    )
    times: dict[str, list[float]] = {"direct": [], "admitted": []}
    try:
        await fill_seconds(pods, client)  # warm-up: connections, scripts loaded
        for _ in range(rounds):
            times["direct"].append(await fill_seconds(pods, None))
            times["admitted"].append(await fill_seconds(pods, client))
    finally:
        await client.close()
        await app.stop()
    direct, admitted = (statistics.median(times[m]) for m in ("direct", "admitted"))
    load = os.getloadavg()
    print(f"fill a pool of {pods} warm pods, {rounds} rounds, load {load[0]:.2f}")
    for mode in ("direct", "admitted"):
        shown = ", ".join(f"{t:.3f}" for t in times[mode])
        print(f"  {mode:<9} median {statistics.median(times[mode]):.3f} s  ({shown})")
    print(f"  admitted / direct: {admitted / direct:.2f}")
    print(f"  added per pod: {(admitted - direct) / pods * 1000:.2f} ms")
    print(
        json.dumps(
            {
                "warm_refill": {
                    "pods": pods,
                    "direct_s": times["direct"],
                    "admitted_s": times["admitted"],
                    "ratio": admitted / direct,
                    "load1": load[0],
                }
            }
        )
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pods", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    asyncio.run(main(args.pods, args.rounds))
