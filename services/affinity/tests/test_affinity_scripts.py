"""Each affinity Lua script against real Redis, edge cases included (SPEC T4, T5, X6)."""

from __future__ import annotations

from typing import Any, cast

import pytest
import redis.asyncio as aioredis

from turnstile_affinity.store import (
    AffinityStore,
    Busy,
    Exhausted,
    Leased,
    MustMove,
    NoRecord,
    Pending,
    RecordMoved,
)

GRACE_MS = 10_000
TTL_MS = 60_000


async def attach(
    store: AffinityStore, sandbox_id: str, tier: str = "a", capacity: int = 2, owner: str = ""
) -> str:
    return await store.attach(
        sandbox_id=sandbox_id,
        owner=owner or f"owner-{sandbox_id}",
        tier=tier,
        capacity=capacity,
        labels={"turnstile.dev/tier": tier} if tier else {},
        endpoint="",
        presence_ttl_ms=TTL_MS,
    )


def place_args(session_id: str = "s", lease_id: str = "l1", **overrides: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "session_id": session_id,
        "session_tier": "a",
        "filtered": True,
        "grace_ms": GRACE_MS,
        "lease_ttl_ms": TTL_MS,
        "lease_id": lease_id,
        "record_ttl_ms": TTL_MS,
    }
    args.update(overrides)
    return args


def claim_args(session_id: str = "s", lease_id: str = "l1", **overrides: Any) -> dict[str, Any]:
    args = place_args(session_id, lease_id, **overrides)
    del args["grace_ms"]
    return args


async def record(store: AffinityStore, session_id: str, sandbox_id: str) -> None:
    claimed = await store.claim(**claim_args(session_id, f"seed-{session_id}"))
    assert isinstance(claimed, Leased)
    assert claimed.sandbox_id == sandbox_id
    assert await store.release(f"seed-{session_id}")


async def test_claim_picks_least_loaded_with_ties_to_the_lowest_id(store: AffinityStore) -> None:
    for sandbox_id in ("c", "a", "b"):
        await attach(store, sandbox_id, capacity=2)
    picked = []
    for i in range(6):
        claimed = await store.claim(**claim_args(f"s{i}", f"l{i}"))
        assert isinstance(claimed, Leased)
        picked.append(claimed.sandbox_id)
    assert picked == ["a", "b", "c", "a", "b", "c"]
    assert isinstance(await store.claim(**claim_args("s9", "l9")), Exhausted)


async def test_claim_is_compare_and_claim(store: AffinityStore) -> None:
    await attach(store, "a1")
    await attach(store, "a2")
    await record(store, "s", "a1")
    second = await store.claim(**claim_args("s", "l2"))
    assert second == RecordMoved("a1")
    assert await store.redis.zcard(store.keys.leases("a2")) == 0


async def test_claim_considers_only_the_tier_unless_unfiltered(store: AffinityStore) -> None:
    await attach(store, "b1", tier="b")
    assert isinstance(await store.claim(**claim_args("s1", "l1")), Exhausted)
    unfiltered = await store.claim(**claim_args("s1", "l1", filtered=False))
    assert isinstance(unfiltered, Leased)
    assert unfiltered.sandbox_id == "b1"


async def test_place_hit_busy_and_no_record(store: AffinityStore) -> None:
    await attach(store, "a1", capacity=1)
    assert await store.place(**place_args("s")) == NoRecord()
    await record(store, "s", "a1")
    hit = await store.place(**place_args("s", "l1"))
    assert isinstance(hit, Leased)
    assert hit.sandbox_id == "a1"
    busy = await store.place(**place_args("s", "l2"))
    assert busy == Busy("a1", "a", 1, 1)


async def test_place_retiered_sandbox_must_move(store: AffinityStore) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await attach(store, "a1", tier="b", owner="newer")
    assert await store.place(**place_args("s")) == MustMove("a1", "retiered")
    assert await store.redis.zscore(store.keys.load("a"), "a1") is None
    assert await store.redis.zscore(store.keys.load("b"), "a1") == 0


@pytest.mark.parametrize("mark", [b"garbage", b"-5", b"1.5", b"99999999999999999"])
async def test_a_garbage_or_future_mark_counts_as_now(store: AffinityStore, mark: bytes) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    await store.redis.set(store.keys.detached("a1"), mark)
    pending = await store.place(**place_args("s"))
    assert isinstance(pending, Pending)
    assert pending.remaining_grace_ms == GRACE_MS
    repaired = int(cast(bytes, await store.redis.get(store.keys.detached("a1"))))
    assert 0 < repaired <= int(await _now_ms(store.redis))
    assert 0 < await store.redis.pttl(store.keys.detached("a1")) <= TTL_MS


async def test_pending_wakes_once_per_absence_and_falls_back_after_grace(
    store: AffinityStore,
) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    first = await store.place(**place_args("s"))
    second = await store.place(**place_args("s"))
    assert isinstance(first, Pending)
    assert isinstance(second, Pending)
    assert (first.woke, second.woke) == (True, False)
    store.clock.offset_ms += GRACE_MS
    assert await store.place(**place_args("s")) == MustMove("a1", "grace")


async def test_first_sight_of_an_absence_without_a_mark_starts_the_grace(
    store: AffinityStore,
) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    store.clock.offset_ms += TTL_MS + 1  # presence expired: nobody wrote a mark
    assert not await store.redis.exists(store.keys.detached("a1"))
    first = await store.place(**place_args("s"))
    assert isinstance(first, Pending)
    assert first.remaining_grace_ms == GRACE_MS
    store.clock.offset_ms += 4000
    later = await store.place(**place_args("s"))
    assert isinstance(later, Pending)
    assert GRACE_MS - 5000 < later.remaining_grace_ms <= GRACE_MS - 4000


async def test_replace_is_compare_and_set_and_records_the_reset(store: AffinityStore) -> None:
    await attach(store, "a1")
    await attach(store, "a2")
    await record(store, "s", "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    args = claim_args("s", "l1")
    moved = await store.replace(**args, expected_sandbox_id="a1", reason="grace")
    assert isinstance(moved, Leased)
    assert moved.sandbox_id == "a2"
    assert moved.reset_at_ms is not None
    stale = await store.replace(**claim_args("s", "l2"), expected_sandbox_id="a1", reason="grace")
    assert stale == RecordMoved("a2")
    assert await store.redis.zcard(store.keys.leases("a2")) == 1
    session = await store.session("s")
    assert session is not None
    assert (session.reset_from, session.reset_to, session.reset_reason) == ("a1", "a2", "grace")


async def test_replace_without_capacity_leaves_the_record(store: AffinityStore) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    result = await store.replace(**claim_args("s"), expected_sandbox_id="a1", reason="grace")
    assert result == Exhausted()
    session = await store.session("s")
    assert session is not None
    assert session.sandbox_id == "a1"


async def test_attach_clears_the_mark_and_the_wake_marker(store: AffinityStore) -> None:
    await store.redis.set(store.keys.detached("a1"), 1)
    await store.redis.set(store.keys.wake("a1"), 1)
    assert await attach(store, "a1") == ""
    assert not await store.redis.exists(store.keys.detached("a1"), store.keys.wake("a1"))
    assert await attach(store, "a1", owner="newer") == "owner-a1"


async def test_detach_by_a_stale_owner_changes_nothing(store: AffinityStore) -> None:
    await attach(store, "a1", owner="old")
    await attach(store, "a1", owner="new")
    assert not await store.detach(sandbox_id="a1", owner="old", mark_ttl_ms=TTL_MS)
    assert await store.redis.exists(store.keys.presence("a1"))
    assert not await store.redis.exists(store.keys.detached("a1"))
    assert await store.detach(sandbox_id="a1", owner="new", mark_ttl_ms=TTL_MS)
    assert not await store.redis.exists(store.keys.presence("a1"))
    assert await store.redis.zscore(store.keys.load(), "a1") is None
    assert await store.redis.zscore(store.keys.load("a"), "a1") is None
    assert 0 < await store.redis.pttl(store.keys.detached("a1")) <= TTL_MS


async def test_detach_after_presence_expired_keeps_an_earlier_mark(store: AffinityStore) -> None:
    await store.redis.set(store.keys.detached("a1"), 12345)
    assert not await store.detach(sandbox_id="a1", owner="gone", mark_ttl_ms=TTL_MS)
    assert await store.redis.get(store.keys.detached("a1")) == b"12345"


async def test_heartbeat_statuses(store: AffinityStore) -> None:
    args = {"sandbox_id": "a1", "presence_ttl_ms": TTL_MS}
    assert await store.heartbeat(owner="o1", **args) == "missing"  # type: ignore[arg-type]
    await attach(store, "a1", owner="o1")
    assert await store.heartbeat(owner="o1", **args) == "ok"  # type: ignore[arg-type]
    assert await store.heartbeat(owner="o2", **args) == "superseded"  # type: ignore[arg-type]
    store.clock.offset_ms += TTL_MS + 1
    assert await store.heartbeat(owner="o1", **args) == "missing"  # type: ignore[arg-type]


async def test_expired_leases_and_presence_leave_the_load_index(store: AffinityStore) -> None:
    await attach(store, "a1", capacity=2)
    await attach(store, "a2", capacity=2)
    await store.claim(**claim_args("s1", "l1", lease_ttl_ms=1000))
    assert await store.redis.zscore(store.keys.load("a"), "a1") == 0.5
    store.clock.offset_ms += 1001
    assert await store.place(**place_args("unknown")) == NoRecord()  # any script prunes
    assert await store.redis.zscore(store.keys.load("a"), "a1") == 0
    assert not await store.redis.hexists(store.keys.lease_sandbox, "l1")
    store.clock.offset_ms += TTL_MS
    assert await store.workers(None) == []
    assert await store.redis.zcard(store.keys.load()) == 0
    assert await store.redis.zcard(store.keys.load("a")) == 0
    assert await store.redis.zcard(store.keys.presence_expiry) == 0


async def test_release_of_an_unknown_lease_is_false(store: AffinityStore) -> None:
    assert not await store.release("nope")
    assert not await store.release("nope", "a1")


async def test_presence_and_leases_keys_carry_expiries(store: AffinityStore) -> None:
    await attach(store, "a1")
    await store.claim(**claim_args("s1", "l1"))
    for key in (store.keys.presence("a1"), store.keys.leases("a1"), store.keys.session("s1")):
        assert 0 < await store.redis.pttl(key) <= TTL_MS, key


async def _now_ms(redis: aioredis.Redis) -> int:
    seconds, micros = await redis.time()
    return seconds * 1000 + micros // 1000
