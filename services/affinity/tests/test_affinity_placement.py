"""Place through the real service, with real worker agents attached to its relay (SPEC T6, T7)."""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest

from turnstile_contracts import affinity_pb2

if TYPE_CHECKING:
    from conftest import Affinity, StartAffinity, StartWorker, Worker

HIT = affinity_pb2.PLACEMENT_OUTCOME_HIT
FIRST = affinity_pb2.PLACEMENT_OUTCOME_FIRST
FALLBACK = affinity_pb2.PLACEMENT_OUTCOME_FALLBACK


async def two_tiers(
    affinity: StartAffinity, worker: StartWorker, **settings: object
) -> tuple[Affinity, dict[str, Worker]]:
    """Two tiers of two workers each: a1, a2 in tier a; b1, b2 in tier b."""
    service = await affinity(tiers="a,b", **settings)
    workers = {
        sandbox_id: await worker(service.address, sandbox_id, sandbox_id[0], capacity=4)
        for sandbox_id in ("a1", "a2", "b1", "b2")
    }
    return service, workers


async def test_sessions_are_placed_only_in_their_tier(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service, _ = await two_tiers(affinity, worker)
    placed_a = [await service.place(f"sa{i}", "a") for i in range(6)]
    placed_b = [await service.place(f"sb{i}", "b") for i in range(6)]
    assert {p.sandbox_id for p in placed_a} == {"a1", "a2"}
    assert {p.sandbox_id for p in placed_b} == {"b1", "b2"}
    assert {p.tier for p in placed_a} == {"a"}
    assert {p.tier for p in placed_b} == {"b"}


async def test_empty_tier_means_the_default_tier(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service, _ = await two_tiers(affinity, worker, default_tier="b")
    placed = await service.place("s1", "")
    assert placed.sandbox_id in {"b1", "b2"}
    assert placed.tier == "b"


async def test_first_turns_spread_exactly_by_load_with_ties_to_the_lowest_id(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service, _ = await two_tiers(affinity, worker)
    order = [(await service.place(f"s{i}", "a")).sandbox_id for i in range(8)]
    assert order == ["a1", "a2"] * 4
    workers = await service.workers("a")
    assert workers["a1"].leases == workers["a2"].leases == 4


async def test_spread_follows_released_leases(affinity: StartAffinity, worker: StartWorker) -> None:
    service, _ = await two_tiers(affinity, worker)
    first = [await service.place(f"s{i}", "a") for i in range(4)]  # a1, a2, a1, a2
    for placed in first:
        if placed.sandbox_id == "a1":
            assert await service.release(placed)
    assert (await service.place("new", "a")).sandbox_id == "a1"


async def test_a_session_stays_on_its_sandbox_across_turns(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service, _ = await two_tiers(affinity, worker)
    first = await service.place("chat", "a")
    assert first.outcome == FIRST
    await service.release(first)
    await service.place("other-1", "a")  # load the other sandbox: affinity, not load, decides
    for _ in range(3):
        again = await service.place("chat", "a")
        assert (again.sandbox_id, again.outcome) == (first.sandbox_id, HIT)
        assert not again.HasField("reset")
        await service.release(again)


async def test_affinity_holds_across_replicas_sharing_redis(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    one, _ = await two_tiers(affinity, worker)
    two = await affinity(tiers="a,b")
    first = await one.place("chat", "a")
    again = await two.place("chat", "a")
    assert (again.sandbox_id, again.outcome) == (first.sandbox_id, HIT)


async def test_a_record_from_another_tier_is_honoured_when_its_sandbox_is_in_this_tier(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    # Written before tiers were on: no filtering, the session landed on a1.
    unfiltered = await affinity()
    await worker(unfiltered.address, "a1", "a")
    before = await unfiltered.place("chat", "legacy")
    assert before.sandbox_id == "a1"
    tiered = await affinity(tiers="a,b")
    await worker(tiered.address, "a2", "a")
    after = await tiered.place("chat", "a")
    assert (after.sandbox_id, after.outcome) == ("a1", HIT)
    session = await tiered.stub.GetSession(
        affinity_pb2.GetSessionRequest(client_id="acme", session_id="chat")
    )
    assert session.tier == "a"


async def test_a_session_whose_sandbox_moved_to_another_declared_tier_falls_back(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service, workers = await two_tiers(affinity, worker)
    first = await service.place("chat", "a")
    await service.release(first)
    assert first.sandbox_id == "a1"
    await workers["a1"].stop()
    await worker(service.address, "a1", "b")  # a1 comes back serving tier b
    moved = await service.place("chat", "a")
    assert moved.outcome == FALLBACK
    assert moved.sandbox_id == "a2"
    assert moved.reset.reason == affinity_pb2.RESET_REASON_RETIERED
    assert (moved.reset.from_sandbox_id, moved.reset.to_sandbox_id) == ("a1", "a2")


async def test_with_no_tiers_configured_nothing_is_filtered(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service = await affinity()
    await worker(service.address, "w1", "a", capacity=1)
    await worker(service.address, "w2", "b", capacity=1)
    await worker(service.address, "w3", "", capacity=1)  # no tier label at all
    placed = [await service.place(f"s{i}", "whatever") for i in range(3)]
    assert sorted(p.sandbox_id for p in placed) == ["w1", "w2", "w3"]
    await service.release(placed[0])
    again = await service.place("s0", "something-else")
    assert (again.sandbox_id, again.outcome) == (placed[0].sandbox_id, HIT)


async def test_a_busy_sandbox_refuses_naming_it_and_takes_no_lease(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service = await affinity(tiers="a", retry_after_s=7)
    await worker(service.address, "a1", "a", capacity=1)
    await worker(service.address, "a2", "a", capacity=1)
    held = await service.place("chat", "a")
    await service.place("filler", "a")
    refusal = await service.refused("chat", "a")
    assert refusal.code == grpc.StatusCode.UNAVAILABLE
    assert refusal.reason == "SANDBOX_BUSY"
    assert refusal.metadata["sandbox_id"] == held.sandbox_id
    assert refusal.retry_after_s == 7
    assert (await service.workers())[held.sandbox_id].leases == 1
    await service.release(held)
    assert (await service.place("chat", "a")).sandbox_id == held.sandbox_id


async def test_a_tier_without_capacity_is_resource_exhausted(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service = await affinity(tiers="a,b", retry_after_s=3)
    await worker(service.address, "a1", "a", capacity=1)
    await service.place("s1", "a")
    refusal = await service.refused("s2", "a")
    assert refusal.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert refusal.reason == "TIER_EXHAUSTED"
    assert refusal.metadata["tier"] == "a"
    assert refusal.retry_after_s == 3
    assert refusal.quota_violations[0].subject == "tier:a"
    empty = await service.refused("s3", "b")  # no worker at all in b
    assert empty.reason == "TIER_EXHAUSTED"


async def test_concurrent_first_turns_converge_on_one_sandbox(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    one = await affinity(tiers="a")
    two = await affinity(tiers="a")
    for sandbox_id in ("a1", "a2", "a3"):
        await worker(one.address, sandbox_id, "a", capacity=16)
    for round_ in range(5):
        session = f"chat-{round_}"
        calls = [(one if i % 2 else two).place(session, "a") for i in range(12)]
        placed = await asyncio.gather(*calls)
        assert len({p.sandbox_id for p in placed}) == 1, placed
        outcomes = Counter(p.outcome for p in placed)
        assert outcomes == {FIRST: 1, HIT: 11}
        for p in placed:
            await one.release(p)


async def test_bad_input_is_invalid_argument_naming_the_field_and_changes_nothing(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service = await affinity(tiers="a")
    await worker(service.address, "a1", "a")
    cases = [
        (affinity_pb2.PlaceRequest(client_id="acme", session_id="", tier="a"), "session_id"),
        (
            affinity_pb2.PlaceRequest(client_id="acme", session_id="has space", tier="a"),
            "session_id",
        ),
        (affinity_pb2.PlaceRequest(client_id="acme", session_id="x" * 129, tier="a"), "session_id"),
        (affinity_pb2.PlaceRequest(client_id="acme", session_id="ok", tier="gpu"), "tier"),
    ]
    for request, field in cases:
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await service.stub.Place(request)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert f"{field}:" in (raised.value.details() or "")
    assert (await service.workers())["a1"].leases == 0
    with pytest.raises(grpc.aio.AioRpcError) as missing:
        await service.stub.GetSession(
            affinity_pb2.GetSessionRequest(client_id="acme", session_id="ok")
        )
    assert missing.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.aio.AioRpcError) as bad_release:
        await service.stub.ReleaseLease(
            affinity_pb2.ReleaseLeaseRequest(sandbox_id="a1", lease_id="nope")
        )
    assert "lease_id:" in (bad_release.value.details() or "")
