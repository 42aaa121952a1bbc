"""Concurrent Admits for one key never admit past the cap, and never take the last
slot of a node twice (real gRPC, real Redis, real concurrency)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from turnstile_contracts import admission_pb2, common_pb2

ADMITTED = admission_pb2.DECISION_ADMITTED


def cold(sandbox_id: str, client_id: str = "acme", **extra: Any) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id=client_id),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
        **extra,
    )


async def admit_many(stub: Any, requests: list[admission_pb2.AdmitRequest]) -> list[Any]:
    return list(await asyncio.gather(*(stub.Admit(r) for r in requests)))


# Rate and concurrency are set out of the way so the cap alone decides. The live
# count comes from the live set in Redis, read inside the decision script.
ROOMY: dict[str, Any] = {
    "client_allowlist": ("acme",),
    "rpc_timeout_s": 30,
    "rate": {"default_burst": 1000, "cluster_burst": 1000},
    "concurrency": {"default_limit": 1000},
    "cap": {"default_cap": 7},
}


@pytest.mark.redis_topologies("cluster")
async def test_200_concurrent_admits_with_no_live_pods_admit_exactly_the_cap(
    start_admission: Any,
) -> None:
    running = await start_admission(**ROOMY)
    answers = await admit_many(running.stub, [cold(f"sb-{i}") for i in range(200)])
    admitted = [a for a in answers if a.decision == ADMITTED]
    details = {v.detail for a in admitted for v in a.verdicts if v.detail}
    assert len(admitted) == 7, details
    refused = [a for a in answers if a.decision != ADMITTED]
    assert all(a.refused_by == admission_pb2.POLICY_CAP for a in refused)
    assert all(a.limit == 7 and a.current == 7 for a in refused)


async def test_200_concurrent_admits_with_live_pods_admit_cap_minus_live(
    start_admission: Any, live: Any
) -> None:
    await live.counted("acme", "live-1", "live-2", "live-3")
    running = await start_admission(**ROOMY)
    answers = await admit_many(running.stub, [cold(f"sb-{i}") for i in range(200)])
    admitted = [a for a in answers if a.decision == ADMITTED]
    details = {v.detail for a in admitted for v in a.verdicts if v.detail}
    assert len(admitted) == 7 - 3, details
    refused = [a for a in answers if a.decision != ADMITTED]
    assert all(a.limit == 7 and a.current == 7 for a in refused)


async def test_pending_entry_seen_live_is_not_counted_twice(
    start_admission: Any, live: Any
) -> None:
    running = await start_admission(**{**ROOMY, "cap": {**ROOMY["cap"], "default_cap": 2}})
    first = await running.stub.Admit(cold("sb-1"))
    await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=first.hold_id))
    await live.counted("acme", "sb-1")  # its pod is live; as the leader would, move it
    await live.redis.zrem(live.keys.pending("acme"), "sb-1")
    second = await running.stub.Admit(cold("sb-2"))
    assert second.decision == ADMITTED
    cap = next(v for v in second.verdicts if v.policy == admission_pb2.POLICY_CAP)
    assert cap.current == 1  # sb-1 once (live), not twice (live + pending)


async def test_a_sandbox_already_live_is_not_added_to_the_pending_set(
    start_admission: Any, live: Any
) -> None:
    await live.counted("acme", "sb-1")
    running = await start_admission(**{**ROOMY, "cap": {**ROOMY["cap"], "default_cap": 2}})
    again = await running.stub.Admit(cold("sb-1"))  # e.g. a restore racing its own pod
    assert again.decision == ADMITTED
    assert await live.redis.zcard(live.keys.pending("acme")) == 0
    other = await running.stub.Admit(cold("sb-2"))
    cap = next(v for v in other.verdicts if v.policy == admission_pb2.POLICY_CAP)
    assert cap.current == 1


@pytest.mark.parametrize("creates", [50])
async def test_concurrent_cold_creates_never_take_the_last_slot_of_a_node_twice(
    start_admission: Any, creates: int
) -> None:
    running = await start_admission(
        **{
            **ROOMY,
            "cap": {**ROOMY["cap"], "default_cap": 1000},
            "slots": {"per_node": {"n1": 3, "n2": 2}},
        }
    )
    answers = await admit_many(
        running.stub, [cold(f"sb-{i}", candidate_nodes=["n1", "n2"]) for i in range(creates)]
    )
    nodes = [a.node for a in answers if a.decision == ADMITTED]
    assert sorted(nodes) == ["n1", "n1", "n1", "n2", "n2"]
    refused = [a for a in answers if a.decision != ADMITTED]
    assert all(a.refused_by == admission_pb2.POLICY_NODE_SLOTS for a in refused)
