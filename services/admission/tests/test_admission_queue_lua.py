"""The fair queue's scripts (enqueue, tick, claim, leave) against real Redis, on a
frozen clock: grants never exceed the bucket, FIFO within a key, weighted fair
across keys, and a waiter that leaves, expires or loses its replica holds nothing."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from turnstile_admission.fairness import level_indexes
from turnstile_admission.policies import PolicyName, RateSettings
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs
from turnstile_admission.settings import AdmissionSettings, QueueSettings
from turnstile_clientkeys.limits import Limits, LimitsStore

if TYPE_CHECKING:
    from conftest import LiveSets

NOW = 7_000_000
RATE = 10.0  # tokens per second: one every 100 ms
RATE_ONLY = {PolicyName.CAP: 0, PolicyName.RATE: 2, PolicyName.CONCURRENCY: 0, PolicyName.SLOTS: 0}
TTL = 600_000


@pytest.fixture
async def store(redis: aioredis.Redis, redis_prefix: str, live: LiveSets) -> AdmissionStore:
    settings = AdmissionSettings(
        redis_prefix=redis_prefix,
        test_clock=True,
        rate=RateSettings(
            cluster_rate_per_s=RATE, cluster_burst=1, default_rate_per_s=1000, default_burst=1000
        ),
        queue=QueueSettings(claim_ttl_s=2, owner_ttl_s=3),
    )
    store = AdmissionStore(redis, settings)
    await store.set_test_clock(NOW)
    return store


async def drain_bucket(store: AdmissionStore, key: str = "drain") -> None:
    """Take the cluster bucket's one token (burst 1) so waiters must wait."""
    answer = await store.admit(AdmitArgs("h-drain", key, "sb-drain", RATE_ONLY))
    assert answer.outcome == "admit"


#: The queue's bookkeeping, which outlives its waiters (each with a TTL).
BOOKKEEPING = (b"q:meta", b"q:vf", b"q:owners", b"q:pace")


async def queue_keys(redis: aioredis.Redis, prefix: str) -> list[bytes]:
    """The queue's keys that hold waiters, grants or its serving mark."""
    keys = [k async for k in redis.scan_iter(match=f"{prefix}{{adm}}:q:*")]
    return sorted(k for k in keys if not k.endswith(BOOKKEEPING))


async def test_tick_grants_one_token_per_refill_in_fifo_order(store: AdmissionStore) -> None:
    await drain_bucket(store)
    for n in range(3):
        queued = await store.enqueue(f"w{n}", "acme", "r1", 10_000, TTL)
        assert queued.queued
        assert queued.position == n + 1
    assert (await store.tick("r1")).granted == ()  # the bucket is empty
    granted: list[str] = []
    for step in range(1, 4):
        await store.set_test_clock(NOW + step * 100)
        tick = await store.tick("r1")
        assert tick.grants == 1  # one token refilled, never more
        granted += tick.granted
    assert granted == ["w0", "w1", "w2"]


async def test_a_grant_is_reported_once_to_its_own_replica(store: AdmissionStore) -> None:
    await drain_bucket(store)
    await store.enqueue("w-b", "acme", "rb", 10_000, TTL)
    await store.set_test_clock(NOW + 100)
    by_a = await store.tick("ra")  # replica a's tick grants replica b's waiter
    assert by_a.grants == 1
    assert by_a.granted == ()
    assert (await store.tick("rb")).granted == ("w-b",)
    assert (await store.tick("rb")).granted == ()  # never twice


async def test_claim_takes_the_granted_token_and_nothing_more(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await drain_bucket(store)
    await store.enqueue("w1", "acme", "r1", 10_000, TTL)
    await store.set_test_clock(NOW + 100)
    assert (await store.tick("r1")).granted == ("w1",)
    claimed = await store.admit(AdmitArgs("h1", "acme", "sb-1", RATE_ONLY), claim="w1")
    assert claimed.outcome == "admit"
    # The grant is spent: a second claim finds nothing, an outsider finds no token.
    again = await store.admit(AdmitArgs("h2", "acme", "sb-2", RATE_ONLY), claim="w1")
    assert again.outcome == "lost"
    outsider = await store.admit(AdmitArgs("h3", "other", "sb-3", RATE_ONLY))
    assert outsider.outcome == "refuse"
    assert await queue_keys(redis, redis_prefix) == []


async def test_while_waiters_are_served_outsiders_do_not_jump_the_queue(
    store: AdmissionStore,
) -> None:
    await drain_bucket(store)
    await store.enqueue("w1", "acme", "r1", 10_000, TTL)
    await store.tick("r1")  # marks the queue served
    await store.set_test_clock(NOW + 500)  # five tokens refilled (burst 1: one)
    outsider = await store.admit(AdmitArgs("h-out", "other", "sb-out", RATE_ONLY))
    assert outsider.outcome == "refuse"
    assert outsider.results[PolicyName.RATE].detail == "cluster bucket"
    assert (await store.tick("r1")).granted == ("w1",)


async def test_keys_share_the_bucket_by_weight_and_fifo_within_each(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await LimitsStore(redis, redis_prefix).set_key("gold", Limits(weight=3))
    await drain_bucket(store)
    for n in range(40):
        await store.enqueue(f"heavy-{n}", "heavy", "r1", 100_000, TTL)
    for n in range(20):
        await store.enqueue(f"gold-{n}", "gold", "r1", 100_000, TTL)
    for n in range(5):
        await store.enqueue(f"light-{n}", "light", "r1", 100_000, TTL)
    order: list[str] = []
    for step in range(1, 21):
        await store.set_test_clock(NOW + step * 100)
        order += (await store.tick("r1")).granted
    shares = Counter(w.rsplit("-", 1)[0] for w in order)
    # 20 grants over weights 1:3:1 while all three wait: 4, 12, 4.
    assert shares == {"heavy": 4, "gold": 12, "light": 4}
    for key in shares:
        mine = [int(w.rsplit("-", 1)[1]) for w in order if w.startswith(key)]
        assert mine == sorted(mine) == list(range(len(mine)))


async def test_an_idle_key_banks_no_credit(store: AdmissionStore) -> None:
    """Work-conserving: while one key waits alone it gets every token; a key that
    joins later gets its share from then on, not a backlog of turns."""
    await drain_bucket(store)
    for n in range(30):
        await store.enqueue(f"heavy-{n}", "heavy", "r1", 100_000, TTL)
    order: list[str] = []
    for step in range(1, 11):
        await store.set_test_clock(NOW + step * 100)
        order += (await store.tick("r1")).granted
    assert len(order) == 10
    assert all(w.startswith("heavy") for w in order)
    for n in range(10):
        await store.enqueue(f"late-{n}", "late", "r1", 100_000, TTL)
    later: list[str] = []
    for step in range(11, 21):
        await store.set_test_clock(NOW + step * 100)
        later += (await store.tick("r1")).granted
    assert Counter(w.split("-")[0] for w in later) == {"heavy": 5, "late": 5}


async def test_leave_returns_an_unclaimed_grant(store: AdmissionStore) -> None:
    await drain_bucket(store)
    await store.enqueue("w1", "acme", "r1", 10_000, TTL)
    await store.set_test_clock(NOW + 100)
    assert (await store.tick("r1")).granted == ("w1",)
    assert await store.leave("w1") == (True, 1.0)
    assert await store.leave("w1") == (False, 0.0)
    # The token is back and the queue is empty: an outsider takes it.
    outsider = await store.admit(AdmitArgs("h-out", "other", "sb-out", RATE_ONLY))
    assert outsider.outcome == "admit"


async def test_expired_waiters_and_abandoned_grants_are_swept(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await drain_bucket(store)
    await store.enqueue("granted", "acme", "r-dead", 60_000, TTL)
    await store.enqueue("short", "acme", "r-dead", 150, TTL)
    await store.set_test_clock(NOW + 100)
    tick = await store.tick("r-live")
    assert tick.grants == 1  # "granted", whose replica never claims it
    await store.set_test_clock(NOW + 100 + 2_001)  # past the claim TTL
    tick = await store.tick("r-live")
    assert tick.swept == 2
    assert tick.returned == 1.0
    assert tick.waiters == 0
    assert tick.lengths == {"platform": 0, "interactive": 0, "batch": 0}
    assert await queue_keys(redis, redis_prefix) == []


async def test_a_dead_replicas_waiters_are_dropped_never_granted(store: AdmissionStore) -> None:
    await drain_bucket(store)
    await store.enqueue("dead-1", "acme", "r-dead", 60_000, TTL)
    await store.enqueue("live-1", "other", "r-live", 60_000, TTL)
    await store.set_test_clock(NOW + 3_001)  # r-dead's owner entry has expired
    tick = await store.tick("r-live")
    assert tick.granted == ("live-1",)
    assert tick.swept == 1
    assert tick.waiters == 1


async def test_an_id_already_waiting_is_not_queued_twice(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """A wait_id reused by a concurrent call (on another replica) derives the same
    waiter id: the second join changes nothing, so the two never share an entry."""
    await drain_bucket(store)
    assert (await store.enqueue("w-same", "acme", "r1", 10_000, TTL)).queued
    info = await redis.hget(f"{redis_prefix}{{adm}}:q:info", "w-same")
    again = await store.enqueue("w-same", "acme", "r2", 60_000, TTL)
    assert not again.queued
    assert again.taken
    assert await redis.hget(f"{redis_prefix}{{adm}}:q:info", "w-same") == info
    await store.set_test_clock(NOW + 100)
    assert (await store.tick("r1")).granted == ("w-same",)  # granted once, to the first


async def test_the_queue_refuses_past_max_waiters(
    redis: aioredis.Redis, redis_prefix: str, live: Any
) -> None:
    settings = AdmissionSettings(redis_prefix=redis_prefix, queue=QueueSettings(max_waiters=2))
    store = AdmissionStore(redis, settings)
    assert (await store.enqueue("w1", "acme", "r1", 10_000, TTL)).queued
    assert (await store.enqueue("w2", "acme", "r1", 10_000, TTL)).queued
    full = await store.enqueue("w3", "acme", "r1", 10_000, TTL)
    assert not full.queued
    assert full.waiters == 2


async def test_one_key_may_fill_only_its_share_of_the_queue(
    redis: aioredis.Redis, redis_prefix: str, live: Any
) -> None:
    """A tenant's flood stops at ``max_key_waiters`` in the queue it joins; another
    key still joins, and the flooding key's refusal changes nothing."""
    settings = AdmissionSettings(
        redis_prefix=redis_prefix, queue=QueueSettings(max_waiters=10, max_key_waiters=2)
    )
    store = AdmissionStore(redis, settings)
    assert (await store.enqueue("w1", "heavy", "r1", 10_000, TTL)).queued
    assert (await store.enqueue("w2", "heavy", "r1", 10_000, TTL)).queued
    info_before = await redis.hgetall(f"{redis_prefix}{{adm}}:q:info")
    full = await store.enqueue("w3", "heavy", "r1", 10_000, TTL)
    assert (full.queued, full.key_full, full.waiters) == (False, True, 2)
    assert await redis.hgetall(f"{redis_prefix}{{adm}}:q:info") == info_before
    light = await store.enqueue("w4", "light", "r1", 10_000, TTL)
    assert (light.queued, light.position) == (True, 1)
    # Each queue has its own share: the key may still wait for a node's slots.
    slot = await store.enqueue("w5", "heavy", "r1", 10_000, TTL, [("n1", 1)])
    assert slot.queued


async def set_level(redis: aioredis.Redis, prefix: str, key: str, level: str) -> None:
    await LimitsStore(redis, prefix).set_key(key, Limits(level=level))


async def grants(store: AdmissionStore, first_step: int, steps: int) -> list[str]:
    order: list[str] = []
    for step in range(first_step, first_step + steps):
        await store.set_test_clock(NOW + step * 100)
        order += (await store.tick("r1")).granted
    return order


async def test_levels_get_their_guaranteed_shares_under_contention(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """SPEC Q2: shares 50/35/15; 40 grants while all three levels wait: 20/14/6."""
    for key, level in (("p", "platform"), ("i", "interactive"), ("b", "batch")):
        await set_level(redis, redis_prefix, key, level)
    await drain_bucket(store)
    for n in range(60):
        for key in ("p", "i", "b"):
            queued = await store.enqueue(f"{key}-{n}", key, "r1", 100_000, TTL)
            assert queued.level == {"p": "platform", "i": "interactive", "b": "batch"}[key]
    shares = Counter(w.split("-")[0] for w in await grants(store, 1, 40))
    assert shares == {"p": 20, "i": 14, "b": 6}
    lengths = (await store.tick("r1")).lengths  # no time has passed: no grant
    assert lengths == {"platform": 40, "interactive": 46, "batch": 54}


async def test_a_levels_unused_share_is_borrowed_and_returned_when_it_waits(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await set_level(redis, redis_prefix, "b", "batch")
    await set_level(redis, redis_prefix, "p", "platform")
    await drain_bucket(store)
    for n in range(60):
        await store.enqueue(f"b-{n}", "b", "r1", 100_000, TTL)
    # Batch alone: every token is batch's (the others' shares borrowed).
    assert Counter(w.split("-")[0] for w in await grants(store, 1, 10)) == {"b": 10}
    # Platform arrives: from its first tick it gets its share back, 50 / (50 + 15),
    # and no backlog of the turns it did not take.
    for n in range(20):
        await store.enqueue(f"p-{n}", "p", "r1", 100_000, TTL)
    first = await grants(store, 11, 1)
    assert first == ["p-0"]  # within one refill interval
    shares = Counter(w.split("-")[0] for w in first + await grants(store, 12, 12))
    assert shares == {"p": 10, "b": 3}


async def test_a_key_without_a_level_waits_in_the_default_level(
    store: AdmissionStore,
) -> None:
    queued = await store.enqueue("w1", "acme", "r1", 10_000, TTL)
    assert queued.level == "interactive"


async def test_the_estimate_honours_key_weights_and_the_grants_keep_it(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """A key of weight 3 beside one of weight 1 gets 3/4 of the bucket, so its
    sixth waiter is estimated at 6 / (10 × 3/4) s = 0.8 s, not the 1.2 s equal
    weights would say; the light key's second at 2 / (10 × 1/4) s = 0.8 s too.
    The ticks grant each within its estimate."""
    await LimitsStore(redis, redis_prefix).set_key("gold", Limits(weight=3))
    await drain_bucket(store)
    estimates: dict[str, int] = {}
    for wid, key in [("light-0", "light"), ("light-1", "light")] + [
        (f"gold-{n}", "gold") for n in range(6)
    ]:
        queued = await store.enqueue(wid, key, "r1", 100_000, TTL)
        estimates[wid] = queued.estimated_wait_ms
    assert estimates["gold-5"] == 800
    assert estimates["light-0"] == 100  # alone, at first
    assert estimates["light-1"] == 200
    # Joined after gold: light's next waiter is estimated at its weight's part.
    queued = await store.enqueue("light-2", "light", "r1", 100_000, TTL)
    assert queued.position == 3
    assert queued.estimated_wait_ms == 1200  # 3 / (10 × 1/4) s
    granted_at: dict[str, int] = {}
    for step in range(1, 13):
        await store.set_test_clock(NOW + step * 100)
        for wid in (await store.tick("r1")).granted:
            granted_at[wid] = step * 100
    assert granted_at["gold-5"] <= estimates["gold-5"]
    assert granted_at["light-2"] <= 1200


async def test_the_queue_counts_joins_and_grants_for_a_minute_only(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await LimitsStore(redis, redis_prefix).set_key("gold", Limits(weight=3))
    await drain_bucket(store)
    for n in range(4):
        await store.enqueue(f"gold-{n}", "gold", "r1", 100_000, TTL)
        await store.enqueue(f"plain-{n}", "plain", "r1", 100_000, TTL)
    for step in range(1, 5):
        await store.set_test_clock(NOW + step * 100)
        await store.tick("r1")
    counts = dict(await store.fairness_counts())
    assert counts["d:interactive:gold"] == "4"
    assert counts["d:interactive:plain"] == "4"
    assert counts["w:interactive:gold"] == "3"
    assert int(counts["g:interactive:gold"]) + int(counts["g:interactive:plain"]) == 4
    assert counts["g:interactive:gold"] == "3"  # weight 3 of 4
    assert level_indexes(await store.fairness_counts())["interactive"] == pytest.approx(1.0)
    # A minute later (and the windows' TTL), nothing is left to score.
    await store.set_test_clock(NOW + 61_000)
    assert await store.fairness_counts() == []


async def test_peek_says_where_a_call_would_join_and_changes_nothing(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    await LimitsStore(redis, redis_prefix).set_key("gold", Limits(weight=3))
    await drain_bucket(store)
    await store.enqueue("plain-0", "plain", "r1", 100_000, TTL)
    for n in range(5):
        await store.enqueue(f"gold-{n}", "gold", "r1", 100_000, TTL)
    before = {k: await redis.dump(k) for k in await queue_keys(redis, redis_prefix)}
    peeked = await store.peek("gold")
    assert (peeked.position, peeked.waiters, peeked.level) == (6, 6, "interactive")
    assert peeked.estimated_wait_ms == 800  # 6 / (10 × 3/4) s, as enqueue would say
    assert {k: await redis.dump(k) for k in await queue_keys(redis, redis_prefix)} == before
    # A key not waiting yet: its weight joins the level's in the estimate.
    newcomer = await store.peek("other")
    assert newcomer.position == 1
    assert newcomer.estimated_wait_ms == 500  # 1 / (10 × 1/5) s
    joined = await store.enqueue("gold-5", "gold", "r1", 100_000, TTL)
    assert (joined.position, joined.estimated_wait_ms) == (6, 800)


async def test_a_waiters_position_and_estimate_follow_the_queue_and_change_nothing(
    store: AdmissionStore, redis: aioredis.Redis, redis_prefix: str
) -> None:
    """queue_position.lua: a waiter's place among its key's waiters now, the wait
    estimated from there (weights honoured, as enqueue's estimate), and how long
    it has waited; granted once a tick grants it, none once claimed or unknown."""
    await LimitsStore(redis, redis_prefix).set_key("gold", Limits(weight=3))
    await drain_bucket(store)
    await store.enqueue("plain-0", "plain", "r1", 100_000, TTL)
    for n in range(6):
        await store.enqueue(f"gold-{n}", "gold", "r1", 100_000, TTL)
    await store.set_test_clock(NOW + 40)
    before = {k: await redis.dump(k) for k in await queue_keys(redis, redis_prefix)}
    last = await store.queue_position("gold-5")
    assert last == ("waiting", 6, 6, 800, 40)  # 6 / (10 × 3/4) s, as it joined
    assert {k: await redis.dump(k) for k in await queue_keys(redis, redis_prefix)} == before
    assert (await store.queue_position("plain-0"))[:4] == ("waiting", 1, 1, 400)  # 1 / 2.5 s
    # Grants move it up, and its estimate with it.
    await store.set_test_clock(NOW + 100)
    assert (await store.tick("r1")).granted == ("gold-0",)
    moved = await store.queue_position("gold-5")
    assert (moved.position, moved.key_waiters, moved.estimated_wait_ms) == (5, 5, 667)
    assert moved.waited_ms == 100
    granted = await store.queue_position("gold-0")
    assert (granted.state, granted.position, granted.waited_ms) == ("granted", 0, 100)
    claimed = await store.admit(AdmitArgs("h1", "gold", "sb-1", RATE_ONLY), claim="gold-0")
    assert claimed.outcome == "admit"
    assert (await store.queue_position("gold-0")).state == "none"
    assert (await store.queue_position("never-joined")).state == "none"
    # Its budget over (not yet swept): not waiting any more.
    await store.set_test_clock(NOW + 100_001)
    assert (await store.queue_position("gold-5")).state == "none"


async def test_a_slot_waiters_position_has_no_estimate(store: AdmissionStore) -> None:
    for n in range(2):
        await store.enqueue(f"s{n}", "acme", "r1", 100_000, TTL, [("n1", 0), ("n2", 0)])
    found = await store.queue_position("s1")
    assert (found.state, found.position, found.key_waiters, found.estimated_wait_ms) == (
        "waiting",
        2,
        2,
        -1,
    )
