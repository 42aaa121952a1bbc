"""The invariant check run after every fault (SPEC X6, P6): no hold, in-flight lease,
node slot or pending entry outlives its expiry, and the live set admission's cap reads
equals the pods that exist."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission.keys import AdmissionKeys
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_substrate.runtime import LABEL_SANDBOX_ID
from turnstile_testing.kube_emulator import KubeEmulator

from .settings import CLIENT, NS, PENDING_TTL_S

#: How long the state may take to settle after the load stops: the TTLs, plus the live
#: publisher's lag and a loaded machine's.
SETTLE_S = PENDING_TTL_S + 20.0


def live_pods(kube: KubeEmulator) -> dict[str, list[str]]:
    """Pod names by sandbox id, of every pod not terminating or finished: the truth."""
    pods: dict[str, list[str]] = {}
    for pod in kube.pods(NS):
        meta = pod["metadata"]
        phase = (pod.get("status") or {}).get("phase")
        if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
            continue
        pods.setdefault(meta["labels"][LABEL_SANDBOX_ID], []).append(meta["name"])
    return pods


@dataclass(frozen=True)
class Ledger:
    """What admission holds for the client, as its own GetUsage reports it (expired
    entries excluded), and the live set the substrate's leader publishes."""

    live: frozenset[str]
    pending: int
    in_flight: int
    node_slots: dict[str, int]
    #: Hold records in Redis without an expiry (a leak: each must expire).
    immortal_holds: int

    def drift(self, pods: dict[str, list[str]]) -> int:
        """|live + pending - runtimes that exist| (SPEC P6 accepts about one, briefly)."""
        return abs(len(self.live) + self.pending - sum(len(v) for v in pods.values()))


async def ledger(admission_address: str, redis: aioredis.Redis, redis_prefix: str) -> Ledger:
    keys = AdmissionKeys(redis_prefix)
    async with grpc.aio.insecure_channel(admission_address) as channel:
        usage = await admission_pb2_grpc.AdmissionServiceStub(channel).GetUsage(
            admission_pb2.GetUsageRequest(client=common_pb2.ActivationClient(client_id=CLIENT)),
            timeout=10,
        )
    live = frozenset(_text(m) for m in await redis.smembers(keys.live(CLIENT)))
    immortal = 0
    async for hold in redis.scan_iter(match=keys.hold("*"), count=1000):
        if await redis.pttl(hold) < 0:
            immortal += 1
    return Ledger(live, usage.pending, usage.in_flight, dict(usage.node_slots_held), immortal)


async def settled(
    admission_address: str, redis: aioredis.Redis, redis_prefix: str, kube: KubeEmulator
) -> tuple[Ledger, float]:
    """Wait (polling: expiry is Redis's clock, the publisher's lag its own) until nothing
    is pending or in flight and the live set equals the pods; the ledger and how long it
    took. Fails the test after :data:`SETTLE_S`."""
    loop = asyncio.get_running_loop()
    started = loop.time()
    last: Ledger | None = None
    try:
        async with asyncio.timeout(SETTLE_S):
            while True:
                last = await ledger(admission_address, redis, redis_prefix)
                pods = live_pods(kube)
                if (last.pending, last.in_flight) == (0, 0) and last.live == set(pods):
                    return last, loop.time() - started
                await asyncio.sleep(0.1)
    except TimeoutError:
        pytest.fail(f"not settled after {SETTLE_S:.0f} s: {last}, pods {sorted(live_pods(kube))}")


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
