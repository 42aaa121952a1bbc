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
    PlaceResult,
    Prepared,
    RecordMoved,
    Turn,
)

GRACE_MS = 10_000
TTL_MS = 60_000


async def attach(
    store: AffinityStore,
    sandbox_id: str,
    tier: str = "a",
    capacity: int = 2,
    owner: str = "",
    generation: str = "g1",
    client: str = "acme",
    scope: str | None = None,
) -> str:
    """Attach ``client``'s sandbox with a verified credential of ``generation``; the
    previous owner (stream)."""
    status, previous = await store.attach(
        sandbox_id=sandbox_id,
        owner=owner or f"owner-{sandbox_id}",
        tier=tier,
        capacity=capacity,
        labels={"turnstile.dev/tier": tier} if tier else {},
        endpoint="",
        presence_ttl_ms=TTL_MS,
        generation=generation,
        client=client,
        scope=scope,
    )
    assert status == "ok", (status, previous)
    return previous


def turn(session_id: str = "s", lease_id: str = "l1", **overrides: Any) -> Turn:
    values: dict[str, Any] = {
        "session_id": session_id,
        "session_tier": "a",
        "filtered": True,
        "lease_id": lease_id,
        "lease_ttl_ms": TTL_MS,
        "record_ttl_ms": TTL_MS,
        "client": "acme",
        "shared": False,
    }
    values.update(overrides)
    return Turn(**values)


async def place(store: AffinityStore, session_id: str = "s", lease_id: str = "l1") -> PlaceResult:
    return await store.place(turn(session_id, lease_id), grace_ms=GRACE_MS)


async def record(store: AffinityStore, session_id: str, sandbox_id: str) -> None:
    claimed = await store.claim(turn(session_id, f"seed-{session_id}"))
    assert isinstance(claimed, Leased)
    assert claimed.sandbox_id == sandbox_id
    assert await store.release(f"seed-{session_id}")


async def test_claim_picks_least_loaded_with_ties_to_the_lowest_id(store: AffinityStore) -> None:
    for sandbox_id in ("c", "a", "b"):
        await attach(store, sandbox_id, capacity=2)
    picked = []
    for i in range(6):
        claimed = await store.claim(turn(f"s{i}", f"l{i}"))
        assert isinstance(claimed, Leased)
        picked.append(claimed.sandbox_id)
    assert picked == ["a", "b", "c", "a", "b", "c"]
    assert isinstance(await store.claim(turn("s9", "l9")), Exhausted)


async def test_claim_is_compare_and_claim(store: AffinityStore) -> None:
    await attach(store, "a1")
    await attach(store, "a2")
    await record(store, "s", "a1")
    second = await store.claim(turn("s", "l2"))
    assert second == RecordMoved("a1")
    assert await store.redis.zcard(store.keys.leases("a2")) == 0


async def test_claim_considers_only_the_tier_unless_unfiltered(store: AffinityStore) -> None:
    await attach(store, "b1", tier="b")
    assert isinstance(await store.claim(turn("s1", "l1")), Exhausted)
    # Without tiers the relay puts every presence in its owner's "*" index.
    await attach(store, "b1", tier="b", scope="*")
    assert await store.redis.zscore(store.keys.own_load("b", "acme"), "b1") is None
    unfiltered = await store.claim(turn("s1", "l1", filtered=False))
    assert isinstance(unfiltered, Leased)
    assert unfiltered.sandbox_id == "b1"


def test_place_request_is_the_request_of_the_turns_keys_and_arguments(
    store: AffinityStore,
) -> None:
    """``place_request`` writes out what :meth:`AffinityStore.request` makes of the
    turn's keys and arguments; the two must not drift apart."""
    for filtered, offset in ((True, 0), (False, 1234)):
        store.clock.offset_ms = offset
        t = turn("s:1", "l1", filtered=filtered, session_tier="b")
        legacy = store.keys.session(t.session_id, None)
        assert store.place_request(t, grace_ms=GRACE_MS) == store.request(
            "place", [*t.keys(store.keys), legacy], *t.args(), GRACE_MS, t.record_ttl_ms
        )


async def test_place_hit_busy_and_no_record(store: AffinityStore) -> None:
    await attach(store, "a1", capacity=1)
    assert await place(store, "s") == NoRecord()
    await record(store, "s", "a1")
    hit = await place(store, "s", "l1")
    assert isinstance(hit, Leased)
    assert hit == Leased("a1", "a", hit.lease_expires_ms, "")
    assert type(hit.lease_expires_ms) is int
    assert hit.lease_expires_ms > 0
    busy = await place(store, "s", "l2")
    assert busy == Busy("a1", "a", 1, 1)


async def test_place_retiered_sandbox_must_move(store: AffinityStore) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await attach(store, "a1", tier="b", owner="newer")
    assert await place(store, "s") == MustMove("a1", "retiered")
    assert await store.redis.zscore(store.keys.own_load("a", "acme"), "a1") is None
    assert await store.redis.zscore(store.keys.own_load("b", "acme"), "a1") == 0


@pytest.mark.parametrize("mark", [b"garbage", b"-5", b"1.5", b"99999999999999999"])
async def test_a_garbage_or_future_mark_counts_as_now(store: AffinityStore, mark: bytes) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    await store.redis.set(store.keys.detached("a1"), mark)
    pending = await place(store, "s")
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
    first = await place(store, "s")
    second = await place(store, "s")
    assert isinstance(first, Pending)
    assert isinstance(second, Pending)
    assert (first.woke, second.woke) == (True, False)
    store.clock.offset_ms += GRACE_MS
    assert await place(store, "s") == MustMove("a1", "grace")


async def prepare(store: AffinityStore, session_id: str = "s", client: str = "acme") -> Prepared:
    return await store.prepare(session_id, client, grace_ms=GRACE_MS, mark_ttl_ms=TTL_MS)


async def test_prepare_reports_each_state_and_shares_the_absences_single_wake_with_place(
    store: AffinityStore,
) -> None:
    """SPEC W2: prepare.lua takes the same wake marker as place.lua, so a Prepare then
    Places (or the reverse) wake the absence once; it takes no lease and leaves the
    record's TTL alone."""
    await attach(store, "a1")
    assert await prepare(store) == Prepared("none")
    await record(store, "s", "a1")
    assert await prepare(store) == Prepared("running", "a1", "a")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    await store.redis.pexpire(store.keys.session("s", "acme"), 5000)

    first = await prepare(store)
    assert (first.state, first.sandbox_id, first.tier, first.woke) == ("pending", "a1", "a", True)
    assert 0 < first.remaining_grace_ms <= GRACE_MS
    again = await prepare(store)
    assert (again.state, again.woke) == ("pending", False)
    turn_after = await place(store, "s")
    assert isinstance(turn_after, Pending)
    assert not turn_after.woke  # the Prepare's wake is the absence's one
    assert await store.redis.zcard(store.keys.lease_expiry) == 0
    assert await store.redis.exists(store.keys.leases("a1")) == 0

    # Place first this time (a new absence): a Prepare after it wakes nothing more.
    await attach(store, "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    placed = await place(store, "s")
    assert isinstance(placed, Pending)
    assert placed.woke
    assert (await prepare(store)).woke is False

    store.clock.offset_ms += GRACE_MS
    assert await prepare(store) == Prepared("moves", "a1", "a")


async def test_prepare_does_not_renew_the_record_and_starts_the_grace_at_first_sight(
    store: AffinityStore,
) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await store.redis.pexpire(store.keys.session("s", "acme"), 5000)
    store.clock.offset_ms += TTL_MS + 1  # presence expired: nobody wrote a mark
    found = await prepare(store)
    assert (found.state, found.remaining_grace_ms, found.woke) == ("pending", GRACE_MS, True)
    assert 0 < await store.redis.pttl(store.keys.session("s", "acme")) <= 5000
    assert await store.redis.exists(store.keys.detached("a1"))


async def test_prepare_of_another_clients_session_or_an_ownerless_one_is_none_and_writes_nothing(
    store: AffinityStore,
) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    await store.redis.hset(store.keys.session("legacy", None), mapping={"sandbox": "a1"})
    before = await snapshot(store)
    assert await prepare(store, "s", client="globex") == Prepared("none")
    assert await prepare(store, "legacy") == Prepared("none")
    assert await snapshot(store) == before


async def test_first_sight_of_an_absence_without_a_mark_starts_the_grace(
    store: AffinityStore,
) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    store.clock.offset_ms += TTL_MS + 1  # presence expired: nobody wrote a mark
    assert not await store.redis.exists(store.keys.detached("a1"))
    first = await place(store, "s")
    assert isinstance(first, Pending)
    assert first.remaining_grace_ms == GRACE_MS
    store.clock.offset_ms += 4000
    later = await place(store, "s")
    assert isinstance(later, Pending)
    assert GRACE_MS - 5000 < later.remaining_grace_ms <= GRACE_MS - 4000


async def test_replace_is_compare_and_set_and_records_the_reset(store: AffinityStore) -> None:
    await attach(store, "a1")
    await attach(store, "a2")
    await record(store, "s", "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    moved = await store.replace(turn("s", "l1"), expected_sandbox_id="a1", reason="grace")
    assert isinstance(moved, Leased)
    assert moved.sandbox_id == "a2"
    assert moved.reset_at_ms is not None
    stale = await store.replace(turn("s", "l2"), expected_sandbox_id="a1", reason="grace")
    assert stale == RecordMoved("a2")
    assert await store.redis.zcard(store.keys.leases("a2")) == 1
    session = await store.session("s", "acme")
    assert session is not None
    assert (session.reset_from, session.reset_to, session.reset_reason) == ("a1", "a2", "grace")


async def test_replace_without_capacity_leaves_the_record(store: AffinityStore) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await store.detach(sandbox_id="a1", owner="owner-a1", mark_ttl_ms=TTL_MS)
    result = await store.replace(turn("s"), expected_sandbox_id="a1", reason="grace")
    assert result == Exhausted()
    session = await store.session("s", "acme")
    assert session is not None
    assert session.sandbox_id == "a1"


async def test_attach_clears_the_mark_and_the_wake_marker(store: AffinityStore) -> None:
    await store.redis.set(store.keys.detached("a1"), 1)
    await store.redis.set(store.keys.wake("a1"), 1)
    assert await attach(store, "a1") == ""
    assert not await store.redis.exists(store.keys.detached("a1"), store.keys.wake("a1"))
    assert await attach(store, "a1", owner="newer") == "owner-a1"


async def snapshot(store: AffinityStore) -> dict[bytes, bytes | None]:
    """Every key of the store, byte for byte (DUMP)."""
    keys = [k async for k in store.redis.scan_iter(match=f"{store.keys.prefix}*", count=1000)]
    return {k: await store.redis.dump(k) for k in sorted(keys)}


async def _attach_status(
    store: AffinityStore, sandbox_id: str, owner: str, generation: str
) -> tuple[str, str]:
    return await store.attach(
        sandbox_id=sandbox_id,
        owner=owner,
        tier="a",
        capacity=2,
        labels={"turnstile.dev/tier": "a"},
        endpoint="",
        presence_ttl_ms=TTL_MS,
        generation=generation,
    )


@pytest.mark.parametrize("record", ["revoked", "g2"])
async def test_attach_with_a_revoked_or_superseded_generation_writes_nothing(
    store: AffinityStore, record: str
) -> None:
    await attach(store, "a1", owner="real", generation="g2" if record == "g2" else "g1")
    await store.redis.set(store.keys.detached("a1"), 1)
    await store.redis.set(store.keys.wake("a1"), 1)
    await store.redis.set(store.keys.credential("a1"), record, px=TTL_MS)
    before = await snapshot(store)
    ttl_before = await store.redis.pttl(store.keys.presence("a1"))
    assert await _attach_status(store, "a1", "impostor", "g1") == ("revoked", "")
    assert await snapshot(store) == before
    assert 0 < await store.redis.pttl(store.keys.presence("a1")) <= ttl_before  # not extended


async def test_attach_with_the_recorded_or_an_unrecorded_generation_takes_over(
    store: AffinityStore,
) -> None:
    await attach(store, "a1", owner="old", generation="g1")
    await store.redis.set(store.keys.credential("a1"), "g1", px=TTL_MS)
    assert await _attach_status(store, "a1", "new", "g1") == ("ok", "old")
    # No record (Redis lost it): the credential's signed expiry is the bound.
    await store.redis.delete(store.keys.credential("a1"))
    assert await _attach_status(store, "a1", "newer", "g1") == ("ok", "new")


async def test_attach_without_proof_never_takes_a_live_presence(store: AffinityStore) -> None:
    await attach(store, "a1", owner="real")
    await store.redis.set(store.keys.detached("a2"), 1)
    before = await snapshot(store)
    assert await _attach_status(store, "a1", "other", "") == ("taken", "real")
    assert await snapshot(store) == before
    # The owner itself re-attaching (its presence vanished meanwhile) needs no proof.
    assert await _attach_status(store, "a1", "real", "") == ("ok", "real")
    # Once the live presence expired, a stream without proof may attach.
    store.clock.offset_ms += TTL_MS + 1
    assert await _attach_status(store, "a1", "other", "") == ("ok", "real")


async def test_heartbeat_of_a_revoked_generation_writes_nothing(store: AffinityStore) -> None:
    await attach(store, "a1", owner="o1", generation="g1")
    await store.redis.set(store.keys.credential("a1"), "revoked", px=TTL_MS)
    store.clock.offset_ms += 1000
    before = await snapshot(store)
    beat = {"sandbox_id": "a1", "owner": "o1", "presence_ttl_ms": TTL_MS}
    assert await store.heartbeat(generation="g1", **beat) == "revoked"  # type: ignore[arg-type]
    assert await snapshot(store) == before
    # Off (no generation), the record is not consulted.
    assert await store.heartbeat(generation="", **beat) == "ok"  # type: ignore[arg-type]


async def test_detach_by_a_stale_owner_changes_nothing(store: AffinityStore) -> None:
    await attach(store, "a1", owner="old")
    await attach(store, "a1", owner="new")
    assert not await store.detach(sandbox_id="a1", owner="old", mark_ttl_ms=TTL_MS)
    assert await store.redis.exists(store.keys.presence("a1"))
    assert not await store.redis.exists(store.keys.detached("a1"))
    assert await store.detach(sandbox_id="a1", owner="new", mark_ttl_ms=TTL_MS)
    assert not await store.redis.exists(store.keys.presence("a1"))
    assert await store.redis.zscore(store.keys.load(), "a1") is None
    assert await store.redis.zscore(store.keys.own_load("a", "acme"), "a1") is None
    assert 0 < await store.redis.pttl(store.keys.detached("a1")) <= TTL_MS


async def test_detach_after_presence_expired_keeps_an_earlier_mark(store: AffinityStore) -> None:
    await store.redis.set(store.keys.detached("a1"), 12345)
    assert not await store.detach(sandbox_id="a1", owner="gone", mark_ttl_ms=TTL_MS)
    assert await store.redis.get(store.keys.detached("a1")) == b"12345"


async def test_heartbeat_statuses(store: AffinityStore) -> None:
    args = {"sandbox_id": "a1", "presence_ttl_ms": TTL_MS, "generation": "g1"}
    assert await store.heartbeat(owner="o1", **args) == "missing"  # type: ignore[arg-type]
    await attach(store, "a1", owner="o1")
    assert await store.heartbeat(owner="o1", **args) == "ok"  # type: ignore[arg-type]
    assert await store.heartbeat(owner="o2", **args) == "superseded"  # type: ignore[arg-type]
    store.clock.offset_ms += TTL_MS + 1
    assert await store.heartbeat(owner="o1", **args) == "missing"  # type: ignore[arg-type]


async def test_expired_leases_and_presence_leave_the_load_index(store: AffinityStore) -> None:
    await attach(store, "a1", capacity=2)
    await attach(store, "a2", capacity=2)
    await store.claim(turn("s1", "l1", lease_ttl_ms=1000))
    assert await store.redis.zscore(store.keys.own_load("a", "acme"), "a1") == 0.5
    store.clock.offset_ms += 1001
    assert await place(store, "unknown") == NoRecord()  # any script prunes
    assert await store.redis.zscore(store.keys.own_load("a", "acme"), "a1") == 0
    assert not await store.redis.hexists(store.keys.lease_sandbox, "l1")
    store.clock.offset_ms += TTL_MS
    assert await store.workers(None) == []
    assert await store.redis.zcard(store.keys.load()) == 0
    assert await store.redis.zcard(store.keys.own_load("a", "acme")) == 0
    assert await store.redis.zcard(store.keys.presence_expiry) == 0


async def test_release_of_an_unknown_lease_is_false(store: AffinityStore) -> None:
    assert not await store.release("nope")
    assert not await store.release("nope", "a1")


async def test_presence_and_leases_keys_carry_expiries(store: AffinityStore) -> None:
    await attach(store, "a1")
    await store.claim(turn("s1", "l1"))
    for key in (
        store.keys.presence("a1"),
        store.keys.leases("a1"),
        store.keys.session("s1", "acme"),
    ):
        assert 0 < await store.redis.pttl(key) <= TTL_MS, key


async def _now_ms(redis: aioredis.Redis | aioredis.RedisCluster) -> int:
    seconds, micros = await redis.time()
    return seconds * 1000 + micros // 1000


# -- ownership (SPEC O2, O3) -----------------------------------------------------


async def test_pick_takes_only_the_clients_own_sandboxes_never_another_or_an_ownerless(
    store: AffinityStore,
) -> None:
    await attach(store, "g1", capacity=100, client="globex")  # least loaded of the tier
    await attach(store, "none", capacity=100, client="")  # ownerless: an old credential
    await attach(store, "a1", capacity=2)
    for i in range(2):
        claimed = await store.claim(turn(f"s{i}", f"l{i}"))
        assert isinstance(claimed, Leased)
        assert claimed.sandbox_id == "a1"
    assert isinstance(await store.claim(turn("s9", "l9")), Exhausted)
    unfiltered = await store.claim(turn("s9", "l9", filtered=False, session_tier=""))
    assert isinstance(unfiltered, Exhausted)
    # The owner indexes hold exactly their owners' sandboxes.
    assert await store.redis.zrange(store.keys.own_load("a", "acme"), 0, -1) == [b"a1"]
    assert await store.redis.zrange(store.keys.own_load("a", "globex"), 0, -1) == [b"g1"]
    assert not [k async for k in store.redis.scan_iter(match=store.keys.own_load("a", ""))]


async def test_the_native_pool_is_a_candidate_only_when_the_tier_shares_it(
    store: AffinityStore,
) -> None:
    await attach(store, "n1", capacity=4, client="native")
    assert isinstance(await store.claim(turn("s1", "l1")), Exhausted)
    shared = await store.claim(turn("s1", "l1", shared=True))
    assert isinstance(shared, Leased)
    assert shared.sandbox_id == "n1"
    # The less loaded of the two wins (n1 at 1/4, a1 at 0/4) ...
    await attach(store, "a1", capacity=4)
    less = await store.claim(turn("s2", "l2", shared=True))
    assert isinstance(less, Leased)
    assert less.sandbox_id == "a1"
    # ... and at a tie (both 1/4) the client's own.
    tie = await store.claim(turn("s3", "l3", shared=True))
    assert isinstance(tie, Leased)
    assert tie.sandbox_id == "a1"
    # The native pool's own sessions use it with or without sharing.
    own = await store.claim(turn("s4", "l4", client="native"))
    assert isinstance(own, Leased)
    assert own.sandbox_id == "n1"


async def test_release_for_another_client_is_false_and_writes_nothing(
    store: AffinityStore,
) -> None:
    await attach(store, "a1")
    await store.claim(turn("s1", "l1"))
    mine = f"{store.keys.prefix}*"
    before = {k: await store.redis.dump(k) async for k in store.redis.scan_iter(match=mine)}
    assert not await store.release("l1", "a1", "globex")
    after = {k: await store.redis.dump(k) async for k in store.redis.scan_iter(match=mine)}
    assert after == before
    assert await store.release("l1", "a1", "acme")


async def test_a_lease_written_before_owners_is_released_by_anyone(store: AffinityStore) -> None:
    await attach(store, "a1")
    await store.claim(turn("s1", "l1"))
    await store.redis.hset(store.keys.lease_sandbox, "l1", "a1")  # the old format
    assert await store.release("l1", "a1", "globex")
    assert await store.redis.zcard(store.keys.leases("a1")) == 0


async def test_an_ownerless_record_is_adopted_only_by_its_sandboxs_owner(
    store: AffinityStore,
) -> None:
    await attach(store, "a1")
    await attach(store, "g1", client="globex")
    legacy = store.keys.session("old", None)
    await store.redis.hset(legacy, mapping={"sandbox": "a1", "tier": "a"})
    assert await store.place(turn("old", "l1", client="globex"), grace_ms=GRACE_MS) == NoRecord()
    assert await store.redis.exists(legacy)
    adopted = await store.place(turn("old", "l2"), grace_ms=GRACE_MS)
    assert isinstance(adopted, Leased)
    assert adopted.sandbox_id == "a1"
    assert not await store.redis.exists(legacy)
    record = await store.session("old", "acme")
    assert record is not None
    assert (record.sandbox_id, record.client) == ("a1", "acme")


async def test_a_recorded_sandbox_of_another_owner_now_must_move(store: AffinityStore) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await attach(store, "a1", client="globex", generation="g2")  # a new runtime, re-owned
    assert await place(store, "s") == MustMove("a1", "not_owned")
    assert await store.redis.zscore(store.keys.own_load("a", "acme"), "a1") is None
    assert await store.redis.zscore(store.keys.own_load("a", "globex"), "a1") is not None


async def test_expired_presence_leaves_its_owner_indexes_old_members_too(
    store: AffinityStore,
) -> None:
    await attach(store, "a1")
    await attach(store, "a2")
    # a2's expiry member as written before owners: "<tier>/<sandbox>".
    score = await store.redis.zscore(store.keys.presence_expiry, "a/a2/acme")
    assert score is not None
    await store.redis.zrem(store.keys.presence_expiry, "a/a2/acme")
    await store.redis.zadd(store.keys.presence_expiry, {"a/a2": score})
    await store.redis.zadd(store.keys.load("a"), {"a2": 0})  # the tier index of then
    store.clock.offset_ms += TTL_MS + 1
    assert await place(store, "unknown") == NoRecord()  # any script prunes
    assert await store.redis.zcard(store.keys.load("a")) == 0
    # a1 left every index; a2's old member named no owner, so its entry stays ...
    assert await store.redis.zrange(store.keys.own_load("a", "acme"), 0, -1) == [b"a2"]
    assert await store.redis.zcard(store.keys.presence_expiry) == 0
    # ... until a pick meets it and repairs it.
    assert isinstance(await store.claim(turn("s", "l1")), Exhausted)
    assert await store.redis.zcard(store.keys.own_load("a", "acme")) == 0


async def test_a_presence_written_before_owners_leaves_its_old_indexes_on_attach(
    store: AffinityStore,
) -> None:
    key = store.keys.presence("a1")
    await store.redis.hset(
        key, mapping={"owner": "o", "tier": "a", "capacity": 2, "labels": "{}", "expires": 1}
    )
    await store.redis.zadd(store.keys.load("a"), {"a1": 0})
    await store.redis.zadd(store.keys.presence_expiry, {"a/a1": 1})
    await attach(store, "a1")
    assert await store.redis.zcard(store.keys.load("a")) == 0
    assert await store.redis.zrange(store.keys.presence_expiry, 0, -1) == [b"a/a1/acme"]
    assert await store.redis.zrange(store.keys.own_load("a", "acme"), 0, -1) == [b"a1"]


async def test_a_recorded_sandbox_now_ownerless_must_move(store: AffinityStore) -> None:
    await attach(store, "a1")
    await record(store, "s", "a1")
    await attach(store, "a1", client="", generation="g2")  # an old credential's runtime
    assert await place(store, "s") == MustMove("a1", "not_owned")
