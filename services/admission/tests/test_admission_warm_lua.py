"""``reserve_warm.lua`` and the prepaid commit (SPEC W3) against real Redis: a warm pod's
creation takes a cluster token and a node slot as a hold the hold scripts settle, only while
activations keep their reserve; a claim of a paid warm pod gives its cluster token back."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from turnstile_admission.policies import PolicyName, RateSettings
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs
from turnstile_admission.settings import AdmissionSettings, WarmSettings

if TYPE_CHECKING:
    from conftest import LiveSets

NOW = 5_000_000
#: Rate only: a warm claim's Admit (no slots for warm claims).
RATE_ONLY = {
    PolicyName.CAP: 0,
    PolicyName.RATE: 2,
    PolicyName.CONCURRENCY: 0,
    PolicyName.SLOTS: 0,
}
SLOTS_ONLY = {**RATE_ONLY, PolicyName.RATE: 0, PolicyName.SLOTS: 2}


@pytest.fixture
async def store(redis: aioredis.Redis, redis_prefix: str, live: LiveSets) -> AdmissionStore:
    """Cluster bucket of 10 refilling at 1/s; the refill keeps 4 tokens and 1 slot a node."""
    settings = AdmissionSettings(
        redis_prefix=redis_prefix,
        test_clock=True,
        hold_ttl_s=10,
        rate=RateSettings(cluster_burst=10, cluster_rate_per_s=1),
        warm=WarmSettings(cluster_reserve=0.4, spare_slots=1),
    )
    store = AdmissionStore(redis, settings)
    await store.set_test_clock(NOW)
    return store


async def dump(client: aioredis.Redis, prefix: str) -> dict[bytes, Any]:
    keys = sorted([k async for k in client.scan_iter(match=f"{prefix}*")])
    return {k: await client.dump(k) for k in keys if b"{adm}:decisions" not in k}


async def cluster_tokens(store: AdmissionStore) -> float:
    return (await store.usage("acme")).cluster_tokens


async def test_a_reservation_takes_a_token_and_a_slot_as_a_hold_with_an_expiry(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    answer = await store.reserve_warm("w1", "warm-a", [("n1", 3)])
    assert (answer.outcome, answer.node, answer.hold_expires_ms) == ("reserved", "n1", NOW + 10_000)
    assert answer.cluster_tokens == pytest.approx(9)
    assert await redis.zrange(store.keys.slots("n1"), 0, -1) == [b"h:w1"]
    hold = await redis.hgetall(store.keys.hold("w1"))
    assert (hold[b"sandbox"], hold[b"key"], hold[b"cluster_tokens"]) == (b"warm-a", b"", b"1")
    assert 10_000 < await redis.pttl(store.keys.hold("w1")) <= 70_000


async def test_the_refill_leaves_the_cluster_bucket_reserve_to_activations(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    # 10 tokens, 4 kept: the refill takes 6, then is refused with the time to the reserve.
    for i in range(6):
        assert (await store.reserve_warm(f"w{i}", f"warm-{i}", [])).outcome == "reserved"
    before = await dump(redis, redis_prefix)
    refused = await store.reserve_warm("w6", "warm-6", [])
    assert (refused.outcome, refused.refused_by) == ("refused", "cluster bucket")
    assert refused.retry_ms == 1_000  # 4 tokens, 5 needed, 1 token/s
    assert await dump(redis, redis_prefix) == before
    # Activations still find the 4 tokens the refill left.
    for i in range(4):
        admitted = await store.admit(AdmitArgs(f"h{i}", "acme", f"sb-{i}", RATE_ONLY))
        assert admitted.outcome == "admit"


async def test_the_refill_takes_nothing_while_activations_wait_in_the_fair_queue(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await redis.set(store.keys.base + "q:serving", "1", px=1000)
    before = await dump(redis, redis_prefix)
    refused = await store.reserve_warm("w1", "warm-a", [("n1", 3)])
    assert (refused.outcome, refused.refused_by, refused.retry_ms) == ("refused", "queue", -1)
    assert await dump(redis, redis_prefix) == before


async def test_the_refill_takes_no_slot_on_a_node_whose_slots_have_waiters(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    """A node with slot waiters keeps what frees there for them (its serving mark):
    the refill goes to the next candidate, or is refused."""
    await redis.set(store.keys.base + "qn:n1:serving", "r1", px=1000)
    answer = await store.reserve_warm("w1", "warm-a", [("n1", 3), ("n2", 3)])
    assert (answer.outcome, answer.node) == ("reserved", "n2")
    refused = await store.reserve_warm("w2", "warm-b", [("n1", 3)])
    assert (refused.outcome, refused.refused_by) == ("refused", "node slots")
    assert await redis.zrange(store.keys.slots("n1"), 0, -1) == []


async def test_the_refill_leaves_each_node_its_spare_slots(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    nodes = [("n1", 2), ("n2", 3)]
    # One spare slot a node: n1 takes one warm pod, n2 two, then neither.
    taken = [(await store.reserve_warm(f"w{i}", f"warm-{i}", nodes)).node for i in range(3)]
    assert taken == ["n1", "n2", "n2"]
    before = await dump(redis, redis_prefix)
    refused = await store.reserve_warm("w3", "warm-3", nodes)
    assert (refused.outcome, refused.refused_by) == ("refused", "node slots")
    assert refused.retry_ms == 10_000  # the first held slot's expiry
    assert await dump(redis, redis_prefix) == before
    # A cold create still finds the spare slot of each node.
    for i, node in enumerate(["n1", "n2"]):
        cold = await store.admit(
            AdmitArgs(f"h{i}", "acme", f"sb-{i}", SLOTS_ONLY, nodes=[(node, dict(nodes)[node])])
        )
        assert (cold.outcome, cold.node) == ("admit", node)


async def test_a_committed_reservation_holds_the_pods_slot_until_it_is_released(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await store.reserve_warm("w1", "warm-a", [("n1", 3)])
    assert await store.commit("w1")
    assert await redis.zrange(store.keys.slots("n1"), 0, -1) == [b"s:warm-a"]
    assert await cluster_tokens(store) == pytest.approx(9)  # the creation's token stays spent
    assert await store.release("warm-a")
    assert await redis.zcard(store.keys.slots("n1")) == 0


async def test_a_cancelled_reservation_returns_its_token_and_slot_and_a_late_one_takes_nothing(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await store.reserve_warm("w1", "warm-a", [("n1", 3)])
    answer = await store.cancel("w1")
    assert (answer.cancelled, answer.client_tokens, answer.cluster_tokens) == (True, 0.0, 1.0)
    assert await cluster_tokens(store) == pytest.approx(10)
    assert await redis.zcard(store.keys.slots("n1")) == 0
    before = await dump(redis, redis_prefix)
    late = await store.reserve_warm("w1", "warm-a", [("n1", 3)])
    assert late.outcome == "cancelled"
    assert await dump(redis, redis_prefix) == before


async def test_a_claim_of_a_paid_warm_pod_gives_its_cluster_token_back(
    store: AdmissionStore,
) -> None:
    """The warm pod paid the cluster bucket when it was made; its claim pays its key's
    bucket alone. A claim that fell back to a cold create keeps the token it took."""
    await store.reserve_warm("w1", "warm-a", [])
    assert await store.commit("w1")
    assert await cluster_tokens(store) == pytest.approx(9)
    for hold, sandbox in (("h1", "sb-1"), ("h2", "sb-2")):
        await store.admit(AdmitArgs(hold, "acme", sandbox, RATE_ONLY))
    assert await cluster_tokens(store) == pytest.approx(7)
    prepaid = await store.commit_answer("h1", prepaid=True)
    assert (prepaid.committed, prepaid.cluster_tokens) == (True, 1.0)
    cold = await store.commit_answer("h2")
    assert (cold.committed, cold.cluster_tokens) == (True, 0.0)
    usage = await store.usage("acme")
    # Three pods made, three cluster tokens; two claims on the key's own bucket.
    assert usage.cluster_tokens == pytest.approx(8)
    assert usage.client_tokens == pytest.approx(usage.client_capacity - 2)


async def test_a_prepaid_commit_never_pushes_the_cluster_bucket_past_its_burst(
    store: AdmissionStore,
) -> None:
    await store.admit(AdmitArgs("h1", "acme", "sb-1", RATE_ONLY))
    await store.set_test_clock(NOW + 600)  # 0.6 of the token refilled at 1/s
    answer = await store.commit_answer("h1", prepaid=True)
    assert answer.cluster_tokens == pytest.approx(0.4)
    assert await cluster_tokens(store) == pytest.approx(10)
    # A second commit of the hold returns nothing.
    again = await store.commit_answer("h1", prepaid=True)
    assert (again.committed, again.cluster_tokens) == (False, 0.0)


async def test_the_reserve_is_a_share_of_the_buckets_stored_burst(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    """A stored cluster limit overrides the settings' burst: the refill keeps 0.4 of
    its 4 tokens, so it takes 2 (4 → 3 → 2; a third would leave 1 < 1.6)."""
    await redis.hset(store.keys.limits, "cluster", '{"burst": 4, "rate": 1}')
    outcomes = [(await store.reserve_warm(f"w{i}", f"warm-{i}", [])).outcome for i in range(3)]
    assert outcomes == ["reserved", "reserved", "refused"]
