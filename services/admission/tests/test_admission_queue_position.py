"""GetQueuePosition through the real gRPC path, on real Redis (SPEC Q1): while an
Admit waits in the fair queue its caller learns its position and an estimated
wait by the wait_id it chose; once answered, the wait is not found; another
client's caller, with the same wait_id, never finds it."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from google.protobuf.duration_pb2 import Duration

from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_testing.eventually import eventually

WAITING = admission_pb2.QUEUE_STATE_WAITING
NOT_FOUND = admission_pb2.QUEUE_STATE_NOT_FOUND
RATE = 0.5  # one token every 2 s while the waiters are looked at


def _client(client_id: str) -> common_pb2.ActivationClient:
    return common_pb2.ActivationClient(client_id=client_id)


def _admit(sandbox_id: str, wait_id: str = "") -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=_client("acme"),
        kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
        wait_budget=Duration(seconds=30),
        wait_id=wait_id,
    )


async def _position(stub: Any, wait_id: str, client: str = "acme") -> Any:
    request = admission_pb2.GetQueuePositionRequest(client=_client(client), wait_id=wait_id)
    return await stub.GetQueuePosition(request)


async def _waiting_at(stub: Any, wait_id: str, position: int) -> bool:
    found = await _position(stub, wait_id)
    return bool(found.state == WAITING and found.position == position)


async def test_a_waiting_call_is_found_by_its_wait_id_until_it_is_answered(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(
        client_allowlist=("acme", "globex"),
        rate={
            "cluster_rate_per_s": RATE,
            "cluster_burst": 1,
            "default_rate_per_s": 1000,
            "default_burst": 1000,
        },
        queue={"tick_interval_s": 0.01},
    )
    limits = LimitsStore(redis, running.settings.redis_prefix)
    # Nothing refills while the two waiters are looked at.
    await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))
    stub = running.stub
    first = await stub.Admit(_admit("sb-first"))
    assert first.decision == admission_pb2.DECISION_ADMITTED
    calls = []
    for n in range(2):
        call = stub.Admit(_admit(f"sb-{n}", f"wait-{n}"), timeout=40)
        calls.append(asyncio.ensure_future(call))
        await eventually(partial(_waiting_at, stub, f"wait-{n}", n + 1), what=f"wait-{n} queued")
    second = await _position(stub, "wait-1")
    assert second.key_waiters == 2
    # Two tokens ahead at 0.001 per second: about 2000 s (the rate set above).
    assert 1500 <= second.estimated_wait.ToMilliseconds() / 1000 <= 2500
    assert second.waited.ToMilliseconds() >= 0
    # Another client asking for the same wait_id learns nothing of acme's wait.
    assert (await _position(stub, "wait-1", "globex")).state == NOT_FOUND
    assert (await _position(stub, "never-used")).state == NOT_FOUND
    await limits.set_cluster(ClusterLimits(rate=50, burst=1))
    for answer in await asyncio.gather(*calls):
        assert answer.decision == admission_pb2.DECISION_ADMITTED
    for n in range(2):
        assert (await _position(stub, f"wait-{n}")).state == NOT_FOUND


async def test_a_wait_id_reused_on_two_replicas_gives_each_call_an_entry_of_its_own(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    """Two calls of one client with the same wait_id, on two replicas, derive the
    same entry id: the second waits under an id of its own instead of sharing the
    first's entry (and its one grant)."""
    settings = {
        "client_allowlist": ("acme",),
        "rate": {"cluster_rate_per_s": RATE, "cluster_burst": 1, "default_burst": 1000},
        "queue": {"tick_interval_s": 0.01},
    }
    one, two = await start_admission(**settings), await start_admission(**settings)
    prefix = one.settings.redis_prefix
    assert two.settings.redis_prefix == prefix
    limits = LimitsStore(redis, prefix)
    await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await one.stub.Admit(_admit("sb-first"))).decision == admission_pb2.DECISION_ADMITTED
    first = asyncio.ensure_future(one.stub.Admit(_admit("sb-a", "same"), timeout=40))
    await eventually(partial(_waiting_at, one.stub, "same", 1), what="the first call queued")
    second = asyncio.ensure_future(two.stub.Admit(_admit("sb-b", "same"), timeout=40))

    async def two_entries() -> bool:
        return int(await redis.hlen(f"{prefix}{{adm}}:q:info")) == 2

    await eventually(two_entries, what="the second call queued under its own id")
    await limits.set_cluster(ClusterLimits(rate=50, burst=1))
    answers = await asyncio.gather(first, second)
    assert [a.decision for a in answers] == [admission_pb2.DECISION_ADMITTED] * 2
    assert answers[0].hold_id != answers[1].hold_id
