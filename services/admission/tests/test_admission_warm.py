"""``ReserveWarm`` over real gRPC (SPEC W3): bad input is INVALID_ARGUMENT naming the field
and changes nothing; a refusal is RESOURCE_EXHAUSTED with ErrorInfo and RetryInfo; under a
burst of real Admits racing the refill, the refill never takes what activations keep."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform.errors import decode
from turnstile_testing.authz import redis_snapshot
from turnstile_testing.eventually import eventually

ACME = common_pb2.ActivationClient(client_id="acme")
COLD = common_pb2.ACTIVATION_KIND_COLD_CREATE


def reserve(**fields: Any) -> admission_pb2.ReserveWarmRequest:
    values: dict[str, Any] = {"tier": "container", "pod_name": "ts-warm-container-ab12", **fields}
    return admission_pb2.ReserveWarmRequest(**values)


def cold(sandbox: str, nodes: tuple[str, ...] = (), **fields: Any) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox, client=ACME, kind=COLD, candidate_nodes=list(nodes), **fields
    )


#: Every per-key limit out of the way: only the cluster bucket and node slots decide.
ROOMY = {
    "client_allowlist": ("acme",),
    "cap": {"default_cap": 1000},
    "concurrency": {"default_limit": 1000},
}


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        pytest.param(reserve(tier=""), "tier", id="empty-tier"),
        pytest.param(reserve(tier="no spaces"), "tier", id="bad-tier"),
        pytest.param(reserve(pod_name=""), "pod_name", id="empty-pod-name"),
        pytest.param(reserve(pod_name="p" * 64), "pod_name", id="oversized-pod-name"),
        pytest.param(
            reserve(candidate_nodes=["n1", "n1"]), "candidate_nodes[1]", id="duplicate-node"
        ),
        pytest.param(reserve(candidate_nodes=["bad node"]), "candidate_nodes[0]", id="bad-node"),
    ],
)
async def test_a_bad_reservation_is_invalid_argument_naming_the_field_and_changes_nothing(
    admission: Any,
    redis: aioredis.Redis,
    redis_prefix: str,
    request_: admission_pb2.ReserveWarmRequest,
    field: str,
) -> None:
    before = await redis_snapshot(redis, redis_prefix)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await admission.stub.ReserveWarm(request_)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = decode(raised.value)
    assert (error.reason, [v.field for v in error.field_violations]) == ("INVALID_FIELD", [field])
    assert await redis_snapshot(redis, redis_prefix) == before


async def test_a_reservation_is_a_hold_the_hold_rpcs_settle(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    admission = await start_admission(slots={"default_per_node": 4})
    stub = admission.stub
    reserved = await stub.ReserveWarm(reserve(candidate_nodes=["n1"]))
    assert (reserved.node, reserved.cluster_tokens) == ("n1", 199)
    assert reserved.hold_expires_at.ToMilliseconds() > 0
    assert (
        await stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=reserved.hold_id))
    ).committed
    usage = await stub.GetUsage(admission_pb2.GetUsageRequest(client=ACME))
    assert dict(usage.node_slots_held) == {"n1": 1}
    released = await stub.ReleaseSandbox(
        admission_pb2.ReleaseSandboxRequest(sandbox_id="ts-warm-container-ab12")
    )
    assert released.released
    failed = await stub.ReserveWarm(reserve(pod_name="ts-warm-container-cd34"))
    cancelled = await stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=failed.hold_id))
    # Its token back, capped at the bucket's burst (it refills at 50 a second meanwhile).
    assert cancelled.cancelled
    assert 0 < cancelled.cluster_tokens_returned <= 1


async def test_a_refusal_carries_error_info_and_a_retry_hint(
    start_admission: Any, redis: aioredis.Redis, redis_prefix: str
) -> None:
    admission = await start_admission(
        rate={"cluster_burst": 4, "cluster_rate_per_s": 2}, warm={"cluster_reserve": 0.75}
    )
    stub = admission.stub
    await stub.ReserveWarm(reserve(pod_name="w-1"))  # 4 → 3 tokens: below 1 + 3 kept
    before = await redis_snapshot(redis, redis_prefix)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.ReserveWarm(reserve(pod_name="w-2"))
    error = decode(raised.value)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.reason == "RATE_LIMITED"
    assert (error.metadata["refused_by"], error.metadata["tier"]) == ("cluster_bucket", "container")
    assert error.retry_after_s is not None
    assert 0 < error.retry_after_s <= 0.5  # the one token missing, at 2 a second
    assert await redis_snapshot(redis, redis_prefix) == before


async def test_a_node_slot_refusal_says_so_with_the_slot_policys_hint(
    start_admission: Any, redis: aioredis.Redis, redis_prefix: str
) -> None:
    admission = await start_admission(slots={"default_per_node": 3}, warm={"spare_slots": 2})
    stub = admission.stub
    await stub.Admit(cold("sb-1", ("n1",)))  # 1 of 3 held: taking one would leave 1 < 2
    before = await redis_snapshot(redis, redis_prefix)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await stub.ReserveWarm(reserve(candidate_nodes=["n1"]))
    error = decode(raised.value)
    assert raised.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert (error.reason, error.metadata["refused_by"]) == ("NODE_SLOTS_EXHAUSTED", "node_slots")
    assert error.retry_after_s == pytest.approx(2.0)  # capped like the slot policy's hint
    assert await redis_snapshot(redis, redis_prefix) == before


async def test_the_refill_is_refused_while_activations_wait_in_the_fair_queue(
    start_admission: Any,
) -> None:
    admission = await start_admission(
        rate={"cluster_burst": 1, "cluster_rate_per_s": 1},
        warm={"cluster_reserve": 0},
        **ROOMY,
    )
    stub = admission.stub
    assert (await stub.Admit(cold("sb-1"))).decision == admission_pb2.DECISION_ADMITTED
    waiting = cold("sb-2")
    waiting.wait_budget.FromSeconds(5)
    waiter = asyncio.ensure_future(stub.Admit(waiting))

    async def queued() -> bool:
        try:
            await stub.ReserveWarm(reserve())
        except grpc.aio.AioRpcError as error:
            return decode(error).metadata.get("refused_by") == "queue"
        raise AssertionError("the refill took a token an activation waits for")

    await eventually(queued, what="the refill refused for the queue's waiter")
    assert (await waiter).decision == admission_pb2.DECISION_ADMITTED


async def warm(stub: Any, i: int, nodes: tuple[str, ...] = ()) -> str:
    """One warm reservation: the node it took (``reserved`` without nodes), or the
    refusal's ErrorInfo reason."""
    try:
        answer = await stub.ReserveWarm(reserve(pod_name=f"warm-{i}", candidate_nodes=nodes))
    except grpc.aio.AioRpcError as error:
        return decode(error).reason
    return str(answer.node) or "reserved"


async def real(stub: Any, i: int, nodes: tuple[str, ...] = ()) -> str:
    """One cold Admit: the node it took (``admitted`` without nodes), or ""."""
    answer = await stub.Admit(cold(f"sb-{i}", nodes))
    if answer.decision != admission_pb2.DECISION_ADMITTED:
        return ""
    return str(answer.node) or "admitted"


async def test_under_a_burst_the_refill_never_takes_the_cluster_bucket_reserve(
    start_admission: Any,
) -> None:
    """A bucket of 20 that keeps 10 for activations: 15 concurrent warm reservations
    take 10; then 30 more race 30 cold Admits and take none, and the activations get
    the 10 kept for them, to the last token."""
    admission = await start_admission(
        rate={"cluster_burst": 20, "cluster_rate_per_s": 0.001},
        warm={"cluster_reserve": 0.5},
        **ROOMY,
    )
    stub = admission.stub
    # The refill alone first: it stops at the reserve, whatever its concurrency.
    alone = await asyncio.gather(*(warm(stub, i) for i in range(15)))
    assert sorted(alone) == ["RATE_LIMITED"] * 5 + ["reserved"] * 10
    # Then it races activations, its calls sent first: they still get the reserve.
    results = await asyncio.gather(
        *(warm(stub, i) for i in range(15, 45)), *(real(stub, i) for i in range(30))
    )
    assert set(results[:30]) == {"RATE_LIMITED"}
    assert results[30:].count("admitted") == 10


async def test_a_refill_racing_activations_from_a_full_bucket_leaves_them_the_reserve(
    start_admission: Any,
) -> None:
    """30 warm reservations and 30 cold Admits at once, interleaved, for a bucket of 20
    that keeps 10: whatever the order Redis sees them in, the refill takes at most 10,
    the activations at least 10, and the bucket is spent to the last token."""
    admission = await start_admission(
        rate={"cluster_burst": 20, "cluster_rate_per_s": 0.001},
        warm={"cluster_reserve": 0.5},
        **ROOMY,
    )
    stub = admission.stub
    results = await asyncio.gather(*(c for i in range(30) for c in (warm(stub, i), real(stub, i))))
    warm_outcomes, real_outcomes = results[0::2], results[1::2]
    assert set(warm_outcomes) <= {"reserved", "RATE_LIMITED"}
    warm_taken, real_taken = warm_outcomes.count("reserved"), real_outcomes.count("admitted")
    assert warm_taken <= 10
    assert real_taken >= 10
    assert warm_taken + real_taken == 20


async def test_under_a_burst_the_refill_leaves_each_node_its_spare_slots(
    start_admission: Any,
) -> None:
    """Two nodes of 6 slots, 2 kept spare: 10 concurrent warm reservations take 4 a
    node; then 20 more race 20 cold Admits and take none, and the cold creates get
    the spare slots."""
    admission = await start_admission(
        slots={"default_per_node": 6}, warm={"spare_slots": 2}, **ROOMY
    )
    stub = admission.stub
    nodes = ("n1", "n2")
    # The refill alone first: 4 a node, whatever its concurrency.
    alone = await asyncio.gather(*(warm(stub, i, nodes) for i in range(10)))
    assert sorted(alone) == ["NODE_SLOTS_EXHAUSTED"] * 2 + ["n1"] * 4 + ["n2"] * 4
    # Then it races cold creates, its calls sent first: they find the spare slots.
    results = await asyncio.gather(
        *(warm(stub, i, nodes) for i in range(10, 30)), *(real(stub, i, nodes) for i in range(20))
    )
    assert set(results[:20]) == {"NODE_SLOTS_EXHAUSTED"}
    assert sorted(n for n in results[20:] if n) == ["n1", "n1", "n2", "n2"]
