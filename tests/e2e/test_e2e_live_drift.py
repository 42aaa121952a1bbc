"""Drift of the live counts in Redis (SPEC S4, P6): many activations and
deactivations through 3 Kubernetes substrate services sharing Redis, PostgreSQL
and the API-server emulator, one of them stopped in the middle. During the run the
pods of the capped client never exceed the cap by more than one; afterwards the
live set plus the pending set in Redis equals the pods that exist. The stopped
replica is the first one started, which normally holds the Lease: its
leader-only work (the live publisher) then passes to another replica, whose
take-over resyncs.

The default size fits the CI budget; ``-m slow`` runs the issue's 1,000 operations.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys import LiveCountKeys
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.server import GrpcService
from turnstile_substrate.runtime import LABEL_SANDBOX_ID
from turnstile_testing.kube_emulator import KubeEmulator

from .kube_stack import API_ONLY, NAMESPACE, kube_services

CAP = 5
REPLICAS = 3


@dataclass
class Fleet:
    kube: KubeEmulator
    substrates: list[GrpcService]
    stubs: list[substrate_pb2_grpc.SubstrateServiceAsyncStub]

    def live_pods(self) -> set[str]:
        live = set()
        for pod in self.kube.pods(NAMESPACE):
            meta = pod["metadata"]
            phase = (pod.get("status") or {}).get("phase")
            if meta.get("deletionTimestamp") or phase in ("Succeeded", "Failed"):
                continue
            live.add(meta["labels"][LABEL_SANDBOX_ID])
        return live


@pytest.fixture
async def fleet(
    redis_url: str, redis_prefix: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Fleet]:
    async with kube_services(
        redis_url,
        redis_prefix,
        database_url,
        monkeypatch,
        replicas=REPLICAS,
        cluster=API_ONLY,
        substrate={"live_counts_ttl_s": 2.0},
        admission={
            "cap": {"default_cap": CAP},
            "rate": {"default_burst": 100_000, "cluster_burst": 100_000},
            "concurrency": {"default_limit": 100_000},
        },
    ) as services:
        channels = [grpc.aio.insecure_channel(app.address) for app in services.substrates]
        try:
            yield Fleet(
                services.kube,
                services.substrates,
                [substrate_pb2_grpc.SubstrateServiceStub(c) for c in channels],
            )
        finally:
            for channel in channels:
                await channel.close(None)


async def _activate(stub: substrate_pb2_grpc.SubstrateServiceAsyncStub, sandbox_id: str) -> bool:
    try:
        await stub.Activate(
            substrate_pb2.ActivateRequest(
                sandbox_id=sandbox_id, client=common_pb2.ActivationClient(client_id="acme")
            )
        )
    except grpc.aio.AioRpcError:
        return False
    return True


async def _deactivate(stub: substrate_pb2_grpc.SubstrateServiceAsyncStub, sandbox_id: str) -> bool:
    with contextlib.suppress(grpc.aio.AioRpcError):
        await stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=sandbox_id))
    return True


async def _drift(fleet: Fleet, redis: aioredis.Redis, prefix: str, operations: int) -> None:
    rng = random.Random(10)
    pool = [f"d-{n:02}" for n in range(CAP * 3)]
    alive = list(range(REPLICAS))
    worst = 0
    batch = 10
    for done in range(0, operations, batch):
        if done >= operations // 2 and len(alive) == REPLICAS:
            await fleet.substrates[0].stop()  # a replica dies in the middle
            alive.remove(0)
        calls = []
        for _ in range(batch):
            stub = fleet.stubs[rng.choice(alive)]
            sandbox = rng.choice(pool)
            if rng.random() < 0.6:
                calls.append(_activate(stub, sandbox))
            else:
                calls.append(_deactivate(stub, sandbox))
        await asyncio.gather(*calls)
        worst = max(worst, len(fleet.live_pods()))
    assert worst <= CAP + 1, f"{worst} pods for a cap of {CAP}"

    keys = LiveCountKeys(prefix)

    async def settled() -> bool:
        live = {_s(m) for m in await redis.smembers(keys.live("acme"))}
        pending = await redis.zcard(keys.pending("acme"))
        return await redis.get(keys.state) is not None and live == fleet.live_pods() and not pending

    async with asyncio.timeout(30):  # the leader follows the watch: poll, bounded
        while True:
            if await settled():
                return
            await asyncio.sleep(0.05)


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def test_live_counts_do_not_drift_across_replicas_and_a_replica_stopping(
    fleet: Fleet, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await _drift(fleet, redis, redis_prefix, operations=120)


@pytest.mark.slow
@pytest.mark.timeout(900)
async def test_live_counts_do_not_drift_over_a_thousand_operations(
    fleet: Fleet, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await _drift(fleet, redis, redis_prefix, operations=1000)
