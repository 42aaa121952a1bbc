"""Edge cases of each admission script, run through the store against real Redis."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from turnstile_admission.policies import (
    CapSettings,
    PolicyName,
)
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs, script_text
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys.live_counts import COUNTED

# The substrate leader's real script: the one consumer of pending entries.
from turnstile_clientkeys.live_store import Change, LiveStore, Op

if TYPE_CHECKING:
    from conftest import LiveSets

NOW = 5_000_000
ALL = {PolicyName.CAP: 2, PolicyName.RATE: 2, PolicyName.CONCURRENCY: 2, PolicyName.SLOTS: 0}
SLOTS = {**ALL, PolicyName.SLOTS: 2}
CAP_ONLY = {PolicyName.CAP: 2, PolicyName.RATE: 0, PolicyName.CONCURRENCY: 0, PolicyName.SLOTS: 0}
SLOTS_ONLY = {**CAP_ONLY, PolicyName.CAP: 0, PolicyName.SLOTS: 2}


@pytest.fixture
async def store(redis: aioredis.Redis, redis_prefix: str, live: LiveSets) -> AdmissionStore:
    settings = AdmissionSettings(
        redis_prefix=redis_prefix, test_clock=True, cap=CapSettings(default_cap=2), hold_ttl_s=10
    )
    store = AdmissionStore(redis, settings)
    await store.set_test_clock(NOW)
    return store


def args(hold: str, sandbox: str, modes: Any = ALL, **extra: Any) -> AdmitArgs:
    return AdmitArgs(hold, "acme", sandbox, modes, **extra)


async def dump(client: aioredis.Redis, prefix: str, log: bool = False) -> dict[bytes, Any]:
    """Every key's value, the decision log's left out unless ``log``."""
    keys = sorted([k async for k in client.scan_iter(match=f"{prefix}*")])
    return {k: await client.dump(k) for k in keys if log or b"{adm}:decisions" not in k}


async def test_admit_refused_changes_no_key(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str, live: LiveSets
) -> None:
    await store.admit(args("h1", "sb-1", SLOTS, nodes=[("n1", 5)]))
    await live.counted("acme", "old-1")
    before = await dump(redis, redis_prefix)
    logged = await redis.xlen(store.keys.decision_stream("acme"))
    refused = await store.admit(args("h2", "sb-2", SLOTS, nodes=[("n1", 5)]))
    assert refused.outcome == "refuse"
    # Nothing but the refusal's own entry in the decision log (SPEC Q3).
    assert await dump(redis, redis_prefix) == before
    assert await redis.xlen(store.keys.decision_stream("acme")) == logged + 1


async def test_admit_counts_the_live_set_and_the_pending_set(
    store: AdmissionStore, live: LiveSets
) -> None:
    await live.counted("acme", "old-1")
    first = await store.admit(args("h1", "sb-1", CAP_ONLY))
    assert (first.outcome, first.results[PolicyName.CAP].current, first.live.live) == (
        "admit",
        1,
        1,
    )
    second = await store.admit(args("h2", "sb-2", CAP_ONLY))
    assert second.outcome == "refuse"
    assert second.results[PolicyName.CAP].current == 2  # one live + one pending


async def test_admit_does_not_count_the_sandboxs_own_entries(
    store: AdmissionStore, live: LiveSets
) -> None:
    await live.counted("acme", "sb-1")
    again = await store.admit(args("h1", "sb-1", CAP_ONLY))  # its own live pod: excluded
    assert (again.outcome, again.results[PolicyName.CAP].current) == ("admit", 0)
    await store.admit(args("h2", "sb-2", CAP_ONLY))
    retry = await store.admit(args("h3", "sb-2", CAP_ONLY))  # its own pending entry
    assert (retry.outcome, retry.results[PolicyName.CAP].current) == ("admit", 1)


async def test_admit_drops_expired_pending_entries(store: AdmissionStore) -> None:
    await store.admit(args("h1", "sb-1", CAP_ONLY))
    await store.set_test_clock(NOW + 60_000)
    await store.admit(args("h2", "sb-2", CAP_ONLY))
    await store.set_test_clock(NOW + 120_000)  # sb-1's entry (120 s) has expired
    answer = await store.admit(args("h3", "sb-3", CAP_ONLY))
    assert answer.outcome == "admit"
    assert answer.results[PolicyName.CAP].current == 1  # sb-2 only
    assert answer.pending_count == 2


async def test_an_expired_pending_entry_is_reported_once_and_a_consumed_one_never(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """admit.lua and usage.lua report the pending entries they drop as expired
    (``turnstile_admission_pending_expired_total``); an entry the substrate's
    leader moved to the live set (live_publish.lua, the real script) was consumed
    and is never reported, even once its expiry has passed."""
    await store.admit(args("h1", "sb-expires", CAP_ONLY))
    await store.admit(args("h2", "sb-consumed", CAP_ONLY))
    leader = LiveStore(redis, redis_prefix, state_ttl_s=60.0)
    await leader.write(1, [Change(Op.SET, "sb-consumed", "acme")], state=COUNTED)

    await store.set_test_clock(NOW + 121_000)  # both entries' 120 s have passed
    first = await store.admit(args("h3", "sb-3", CAP_ONLY))
    again = await store.admit(args("h4", "sb-4", CAP_ONLY))

    assert first.pending_expired == 1  # sb-expires; sb-consumed had left the set
    assert again.pending_expired == 0  # counted once
    assert (first.results[PolicyName.CAP].current, first.live.live) == (1, 1)


async def test_usage_reports_the_expired_pending_entries_it_drops(store: AdmissionStore) -> None:
    await store.admit(args("h1", "sb-1", CAP_ONLY))
    await store.set_test_clock(NOW + 121_000)
    usage = await store.usage("acme")
    assert (usage.pending_ids, usage.pending_expired) == ((), 1)
    assert (await store.usage("acme")).pending_expired == 0
    assert (await store.admit(args("h2", "sb-2", CAP_ONLY))).pending_expired == 0


async def test_admit_without_a_current_count_decides_on_the_pending_set_alone(
    store: AdmissionStore, live: LiveSets
) -> None:
    await live.counted("acme", "old-1", "old-2", "old-3")
    await live.unavailable()
    first = await store.admit(args("h1", "sb-1", CAP_ONLY))
    assert (first.outcome, first.live.live, first.live.unsupported) == ("admit", None, False)
    await store.admit(args("h2", "sb-2", CAP_ONLY))
    third = await store.admit(args("h3", "sb-3", CAP_ONLY))
    cap = third.results[PolicyName.CAP]
    assert (third.outcome, cap.current, cap.code) == ("refuse", 2, 2)
    assert "pending alone" in cap.detail


async def test_admit_with_an_unsupported_count_is_unknown_below_the_cap(
    store: AdmissionStore, live: LiveSets
) -> None:
    await live.unsupported()
    for n in range(2):
        answer = await store.admit(args(f"h{n}", f"sb-{n}", CAP_ONLY))
        assert answer.outcome == "admit"
        assert answer.results[PolicyName.CAP].code == 3
    assert answer.live.unsupported


async def test_admit_with_an_unsupported_count_refuses_when_pending_alone_reaches_the_cap(
    store: AdmissionStore, live: LiveSets
) -> None:
    """Pending entries are sandboxes admitted and not yet gone: a lower bound of the
    live count even when the substrate cannot count, so at the cap they refuse."""
    await live.unsupported()
    for n in range(2):
        assert (await store.admit(args(f"h{n}", f"sb-{n}", CAP_ONLY))).outcome == "admit"
    third = await store.admit(args("h2", "sb-2", CAP_ONLY))
    cap = third.results[PolicyName.CAP]
    assert (third.outcome, cap.code, cap.limit, cap.current) == ("refuse", 2, 2, 2)
    assert "pending alone" in cap.detail
    # The sandbox's own pending entry is not counted against it.
    assert (await store.admit(args("h3", "sb-1", CAP_ONLY))).outcome == "admit"


async def test_admit_takes_the_first_candidate_with_a_free_slot(store: AdmissionStore) -> None:
    first = await store.admit(args("h1", "sb-1", SLOTS_ONLY, nodes=[("n1", 1), ("n2", 1)]))
    second = await store.admit(args("h2", "sb-2", SLOTS_ONLY, nodes=[("n1", 1), ("n2", 1)]))
    assert (first.node, second.node) == ("n1", "n2")
    third = await store.admit(args("h3", "sb-3", SLOTS_ONLY, nodes=[("n1", 1), ("n2", 1)]))
    assert third.outcome == "refuse"
    slots = third.results[PolicyName.SLOTS]
    assert (slots.limit, slots.current, slots.retry_ms) == (2, 2, 10_000)


async def test_admit_counts_only_unexpired_slots_and_hints_from_them(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    """Expired slot entries stay until their node is written, and count for nothing:
    neither in the slots held nor in the retry hint of a refusal."""
    node = [("n1", 2)]
    await store.admit(args("a", "sb-a", SLOTS_ONLY, nodes=node))  # expires NOW + 10 s
    await store.set_test_clock(NOW + 5_000)
    await store.admit(args("b", "sb-b", SLOTS_ONLY, nodes=node))  # expires NOW + 15 s
    await store.set_test_clock(NOW + 11_000)  # a expired, still stored
    third = await store.admit(args("c", "sb-c", SLOTS_ONLY, nodes=node))
    assert (third.node, third.results[PolicyName.SLOTS].current) == ("n1", 1)
    # Written: the expired entry went with the write.
    assert await redis.zrange(store.keys.slots("n1"), 0, -1) == [b"h:b", b"h:c"]
    await store.set_test_clock(NOW + 16_000)  # b expired, still stored
    refused = await store.admit(args("d", "sb-d", SLOTS_ONLY, nodes=[("n1", 1)]))
    slots = refused.results[PolicyName.SLOTS]
    assert (refused.outcome, slots.current, slots.retry_ms) == ("refuse", 1, 5_000)


async def test_admit_keeps_each_written_key_as_long_as_its_newest_entry(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    """A key admit.lua creates gets its entry's TTL; one that exists is lengthened to
    it, never shortened (one PEXPIRE per key: plain when created, GT when not)."""
    k = store.keys
    hold_ms, pending_ms = 10_000, 120_000
    await store.admit(args("h1", "sb-1", SLOTS, nodes=[("n1", 5)]))
    written = {
        k.inflight("acme"): hold_ms,
        k.pending("acme"): pending_ms,
        k.slots("n1"): hold_ms,
        k.nodes: hold_ms,
    }
    for key, ttl in written.items():
        assert ttl - 2_000 < await redis.pttl(key) <= ttl, key
    # Existing keys whose expiry ran short (as an older entry's would) are lengthened.
    for key in written:
        await redis.pexpire(key, 1_000)
    await store.admit(args("h2", "sb-2", SLOTS, nodes=[("n1", 5)]))
    for key, ttl in written.items():
        assert ttl - 2_000 < await redis.pttl(key) <= ttl, key
    # A committed slot outlives a hold: the next hold on its node does not cut it short.
    assert await store.commit("h1")
    committed = await redis.pttl(k.slots("n1"))
    assert committed > hold_ms
    third = await store.admit(args("h3", "sb-3", SLOTS_ONLY, nodes=[("n1", 5)]))
    assert third.node == "n1"
    assert await redis.pttl(k.slots("n1")) > hold_ms
    assert await redis.pttl(k.nodes) > hold_ms


async def test_admit_ignores_a_malformed_limits_document(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await redis.hset(store.keys.limits, mapping={"default": "{not json", "key:acme": '{"cap":"x"}'})
    answer = await store.admit(args("h1", "sb-1", CAP_ONLY))
    assert answer.results[PolicyName.CAP].limit == 2


async def test_commit_releases_the_lease_keeps_pending_and_moves_the_slot(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await store.admit(args("h1", "sb-1", SLOTS, nodes=[("n1", 1)]))
    assert await store.commit("h1")
    assert await redis.zrange(store.keys.slots("n1"), 0, -1) == [b"s:sb-1"]
    usage = await store.usage("acme")
    assert (usage.in_flight, usage.pending_ids) == (0, ("sb-1",))
    # Re-activated on another node without a release: the old slot goes.
    await store.admit(args("h2", "sb-1", SLOTS, nodes=[("n2", 1)]))
    assert await store.commit("h2")
    assert (await store.usage("acme")).node_slots_held == {"n2": 1}


async def test_cancel_leaves_a_later_holds_pending_entry_for_the_same_sandbox(
    store: AdmissionStore,
) -> None:
    await store.admit(args("h1", "sb-1", CAP_ONLY))
    await store.set_test_clock(NOW + 1)
    await store.admit(args("h2", "sb-1", CAP_ONLY))
    assert (await store.cancel("h1")).cancelled
    assert (await store.usage("acme")).pending_ids == ("sb-1",)
    assert (await store.cancel("h2")).cancelled
    assert (await store.usage("acme")).pending_ids == ()


async def test_cancel_refund_is_capped_at_the_bucket_capacity(store: AdmissionStore) -> None:
    await store.admit(args("h1", "sb-1"))
    await store.set_test_clock(NOW + 400)  # 0.8 of the token refilled at 2/s
    answer = await store.cancel("h1")
    assert answer.client_tokens == pytest.approx(0.2)
    assert (await store.usage("acme")).client_tokens == pytest.approx(20.0)


async def test_cancel_of_a_hold_not_yet_taken_leaves_a_tombstone_admit_honours(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """A cancel that ran before its Admit's script reached Redis (SPEC P2, F3)."""
    assert not (await store.cancel("h1")).cancelled
    tombstone = store.keys.settled("h1")
    # Lives as long as a hold record would: hold TTL (10 s here) plus its 60 s grace.
    assert 10_000 < await redis.pttl(tombstone) <= 70_000
    before = await dump(redis, redis_prefix)
    late = await store.admit(args("h1", "sb-1", SLOTS, nodes=[("n1", 5)]))
    assert late.outcome == "cancelled"
    assert late.hold_expires_ms == 0
    assert all(r.code == 0 for r in late.results.values())  # nothing evaluated
    assert await dump(redis, redis_prefix) == before  # nothing taken
    assert (await store.admit(args("h2", "sb-1", SLOTS, nodes=[("n1", 5)]))).outcome == "admit"


async def test_a_cancelled_holds_script_sent_again_takes_nothing(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """A send retried after the script ran once and its hold was cancelled."""
    assert (await store.admit(args("h1", "sb-1", SLOTS, nodes=[("n1", 5)]))).outcome == "admit"
    assert (await store.cancel("h1")).cancelled
    before = await dump(redis, redis_prefix)
    again = await store.admit(args("h1", "sb-1", SLOTS, nodes=[("n1", 5)]))
    assert again.outcome == "cancelled"
    assert await dump(redis, redis_prefix) == before
    usage = await store.usage("acme")
    assert (usage.pending_ids, usage.in_flight, usage.node_slots_held) == ((), 0, {})


async def test_a_committed_holds_script_arriving_again_takes_nothing(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """A commit of a hold Redis never saw (the Admit failed open) settles its id too."""
    assert not await store.commit("h1")
    assert await redis.pttl(store.keys.settled("h1")) > 10_000
    before = await dump(redis, redis_prefix)
    late = await store.admit(args("h1", "sb-1", SLOTS, nodes=[("n1", 5)]))
    assert late.outcome == "cancelled"
    assert await dump(redis, redis_prefix) == before


async def test_release_frees_only_a_committed_slot(store: AdmissionStore) -> None:
    assert not await store.release("sb-1")
    await store.admit(args("h1", "sb-1", SLOTS, nodes=[("n1", 1)]))
    assert not await store.release("sb-1")  # uncommitted: the hold owns the slot
    await store.commit("h1")
    assert await store.release("sb-1")
    assert (await store.usage("acme")).node_slots_held == {}


async def test_release_removes_a_stopped_sandboxs_pending_entry(store: AdmissionStore) -> None:
    await store.admit(args("h1", "sb-1", CAP_ONLY))
    await store.admit(args("h2", "sb-2", CAP_ONLY))
    assert await store.commit("h1")
    assert await store.commit("h2")
    # sb-1 stops before the reflector ever saw it: it must not stay "pending".
    assert await store.release("sb-1")
    assert (await store.usage("acme")).pending_ids == ("sb-2",)
    assert not await store.release("sb-1")


async def test_only_a_test_clock_store_passes_the_test_clock_key(
    redis: aioredis.Redis, redis_prefix: str
) -> None:
    args = AdmitArgs("h1", "acme", "sb-1", dict.fromkeys(PolicyName, 2), nodes=[("n1", 5)])
    production = AdmissionStore(redis, AdmissionSettings(redis_prefix=redis_prefix))
    tested = AdmissionStore(redis, AdmissionSettings(redis_prefix=redis_prefix, test_clock=True))
    clock_key = production.keys.test_clock.encode()

    assert clock_key not in production.admit_request(args)[0]
    assert tested.admit_request(args)[0][-1] == clock_key
    assert "KEYS[#KEYS]" not in script_text("admit.lua")  # the frozen clock's read
    assert "KEYS[#KEYS]" in script_text("admit.lua", test_clock=True)
