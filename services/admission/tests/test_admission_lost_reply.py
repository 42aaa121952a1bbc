"""Redis down mid-Admit (or mid-ReserveWarm) as a lost reply: the script ran (hold,
tokens, in-flight lease, node slot, pending entry taken) but its answer never came back
within the budget. Admission answers by the fail modes — a retryable refusal, or an
admission whose hold the caller settles — and nothing stays stranded."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission.redis_store import script_text
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_testing.eventually import eventually
from turnstile_testing.proxies import ReplyHoldingProxy

ACME = common_pb2.ActivationClient(client_id="acme")


async def until_pending(redis: aioredis.Redis, key: str, count: int) -> None:
    """Wait until Redis itself holds ``count`` pending entries under ``key``."""

    async def held() -> bool:
        return await redis.zcard(key) == count

    await eventually(held, timeout_s=10, interval_s=0.01, what=f"{count} pending under {key}")


async def cached(redis: aioredis.Redis, script: str) -> None:
    """Put ``script`` in Redis's script cache, as any earlier call of it would have:
    with the replies held back, a NOSCRIPT answer is held too and the script never
    runs (a fresh Redis has none cached)."""
    await redis.script_load(script_text(script, test_clock=True))


async def nothing_held(stub: Any) -> None:
    shown = await stub.GetUsage(admission_pb2.GetUsageRequest(client=ACME), timeout=10)
    assert shown.pending == 0
    assert shown.client_tokens == pytest.approx(shown.client_capacity)
    assert shown.cluster_tokens == pytest.approx(shown.cluster_capacity)
    assert shown.in_flight == 0
    assert not any(dict(shown.node_slots_held).values())


async def test_a_lost_reply_to_a_refused_admit_strands_no_hold(
    proxy: ReplyHoldingProxy, redis: aioredis.Redis, start_proxied: Any
) -> None:
    running = await start_proxied(slots={"fail": "closed"})
    await redis.set(running.keys.test_clock, 1_000_000)  # no refill: tokens compare exactly
    pending = running.keys.pending("acme")
    await cached(redis, "admit.lua")

    proxy.hold()
    answer = await running.stub.Admit(
        admission_pb2.AdmitRequest(
            sandbox_id="sb-1",
            client=ACME,
            kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
            candidate_nodes=["n1"],
        ),
        timeout=10,
    )
    await until_pending(redis, pending, 1)  # the script did run: a lost reply

    assert answer.decision == admission_pb2.DECISION_REFUSED
    assert answer.refused_by == admission_pb2.POLICY_NODE_SLOTS
    assert answer.retry_after.ToMilliseconds() > 0
    assert not answer.hold_id

    proxy.release()
    await until_pending(redis, pending, 0)  # admission cancelled the hold by itself
    await nothing_held(running.stub)


async def test_a_lost_reply_to_an_admitted_admit_leaves_a_hold_its_caller_settles(
    proxy: ReplyHoldingProxy, redis: aioredis.Redis, start_proxied: Any
) -> None:
    running = await start_proxied()
    await redis.set(running.keys.test_clock, 1_000_000)
    pending = running.keys.pending("acme")
    await cached(redis, "admit.lua")

    proxy.hold()
    answer = await running.stub.Admit(
        admission_pb2.AdmitRequest(
            sandbox_id="sb-1", client=ACME, kind=common_pb2.ACTIVATION_KIND_COLD_CREATE
        ),
        timeout=10,
    )
    await until_pending(redis, pending, 1)

    assert answer.decision == admission_pb2.DECISION_ADMITTED  # every policy fails open
    assert answer.hold_id

    proxy.release()
    cancelled = await running.stub.CancelHold(
        admission_pb2.CancelHoldRequest(hold_id=answer.hold_id), timeout=10
    )
    assert cancelled.cancelled  # the hold the lost reply took is the one handed out
    await nothing_held(running.stub)


async def test_a_lost_reply_to_a_warm_reservation_strands_no_hold(
    proxy: ReplyHoldingProxy, redis: aioredis.Redis, start_proxied: Any
) -> None:
    """ReserveWarm's script ran (a cluster token and a node slot taken, SPEC W3) but its
    reply was lost: the refill gets UNAVAILABLE and admission cancels the hold itself."""
    running = await start_proxied()
    await redis.set(running.keys.test_clock, 1_000_000)
    slots = running.keys.slots("n1")
    await cached(redis, "reserve_warm.lua")

    proxy.hold()
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await running.stub.ReserveWarm(
            admission_pb2.ReserveWarmRequest(
                tier="container", pod_name="warm-1", candidate_nodes=["n1"]
            ),
            timeout=10,
        )
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    await until_pending(redis, slots, 1)  # the script did run: a lost reply

    proxy.release()
    await until_pending(redis, slots, 0)  # admission cancelled the hold by itself
    await nothing_held(running.stub)
