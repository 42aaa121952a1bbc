"""The cap's count from the Redis live set (SPEC S4): the real admission service
deciding while the substrate's real publishing script (``live_publish.lua``) moves
admitted sandboxes from the pending set to the live set, as a leader does when
its reflector sees their pods. Real gRPC, real Redis, real concurrency."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys.live_counts import COUNTED
from turnstile_clientkeys.live_store import Change, LiveStore, Op
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_testing.admission import admission_settings, running_admission

CAP = 7
ADMITTED = admission_pb2.DECISION_ADMITTED


@pytest.fixture
async def admission(redis_url: str, redis_prefix: str) -> AsyncIterator[Any]:
    settings = admission_settings(
        redis_url,
        redis_prefix,
        client_allowlist=("acme",),
        rpc_timeout_s=30,
        rate={"default_burst": 1000, "cluster_burst": 1000},
        concurrency={"default_limit": 1000},
        cap={"default_cap": CAP},
    )
    async with (
        running_admission(settings) as app,
        grpc.aio.insecure_channel(app.address) as channel,
    ):
        yield admission_pb2_grpc.AdmissionServiceStub(channel)


def cold(sandbox_id: str) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id="acme"),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
    )


async def test_200_admits_racing_the_leaders_moves_admit_exactly_the_cap(
    admission: Any, redis: aioredis.Redis, redis_prefix: str
) -> None:
    store = LiveStore(redis, redis_prefix, state_ttl_s=60)
    keys = store.keys
    await store.write(1, [Change(Op.SET, "old-1", "acme")], state=COUNTED)
    done = asyncio.Event()

    async def leader() -> int:
        """Moves every admitted sandbox to the live set as soon as it sees it."""
        moved = 0
        while not done.is_set():
            for member in await redis.zrange(keys.pending("acme"), 0, -1):
                sandbox = member.decode() if isinstance(member, bytes) else str(member)
                moved += await store.write(1, [Change(Op.SET, sandbox, "acme")])
            await asyncio.sleep(0)
        return moved

    mover = asyncio.create_task(leader())
    answers = await asyncio.gather(*(admission.Admit(cold(f"sb-{n}")) for n in range(200)))
    done.set()
    moved = await mover

    admitted = [a for a in answers if a.decision == ADMITTED]
    assert len(admitted) == CAP - 1  # one was live already
    assert {a.refused_by for a in answers if a.decision != ADMITTED} == {admission_pb2.POLICY_CAP}
    assert moved > 0  # the race happened: some were moved while others were decided
    live = await redis.scard(keys.live("acme"))
    pending = await redis.zcard(keys.pending("acme"))
    assert live + pending == CAP  # each admitted sandbox counted exactly once
