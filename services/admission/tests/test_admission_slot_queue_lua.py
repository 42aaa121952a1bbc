"""Node-slot queuing in the fair queue's scripts, against real Redis on a frozen
clock (SPEC Q1): a slot that frees goes to the node's first waiter inside the
script that frees it (cancel, release, a moved commit, an expired hold swept by a
tick), never past the node's slots, FIFO within a key and fair across keys; a
waiter that leaves, expires or loses its replica holds nothing."""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from turnstile_admission.policies import PolicyName
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs
from turnstile_admission.settings import AdmissionSettings, QueueSettings
from turnstile_clientkeys.limits import Limits, LimitsStore

if TYPE_CHECKING:
    from conftest import LiveSets

NOW = 9_000_000
SLOTS_ONLY = {PolicyName.CAP: 0, PolicyName.RATE: 0, PolicyName.CONCURRENCY: 0, PolicyName.SLOTS: 2}
TTL = 600_000
HOLD_MS = 10_000
N1 = [("n1", 1)]
TWO_SLOTS = [("n1", 2)]


@pytest.fixture
async def store(redis: aioredis.Redis, redis_prefix: str, live: LiveSets) -> AdmissionStore:
    settings = AdmissionSettings(
        redis_prefix=redis_prefix,
        test_clock=True,
        hold_ttl_s=HOLD_MS / 1000,
        queue=QueueSettings(claim_ttl_s=2, owner_ttl_s=3),
    )
    store = AdmissionStore(redis, settings)
    await store.set_test_clock(NOW)
    return store


def cold(hold: str, nodes: list[tuple[str, int]] = N1, key: str = "acme") -> AdmitArgs:
    return AdmitArgs(hold, key, f"sb-{hold}", SLOTS_ONLY, nodes=nodes)


async def take(store: AdmissionStore, hold: str, nodes: list[tuple[str, int]] = N1) -> str:
    answer = await store.admit(cold(hold, nodes))
    assert answer.outcome == "admit", answer
    return answer.node


async def wait(
    store: AdmissionStore, wid: str, key: str = "acme", nodes: list[tuple[str, int]] = N1
) -> None:
    queued = await store.enqueue(wid, key, "r1", 60_000, TTL, nodes)
    assert queued.queued


async def slot_queue_keys(redis: aioredis.Redis, prefix: str) -> list[bytes]:
    """The keys that hold slot waiters, grants or a node's serving mark (the
    per-node virtual times, the settings in q:slotq and the grant pace are
    bookkeeping)."""
    keys = [k async for k in redis.scan_iter(match=f"{prefix}{{adm}}:q*")]
    bookkeeping = (b":meta", b":vf", b"q:owners", b"q:slotq", b"q:pace")
    return sorted(k for k in keys if not k.endswith(bookkeeping))


async def held(redis: aioredis.Redis, store: AdmissionStore, node: str = "n1") -> list[bytes]:
    members = await redis.zrange(store.keys.slots(node), 0, -1)
    return sorted(m for m in members if isinstance(m, bytes))


async def test_a_cancelled_hold_grants_its_slot_to_the_first_waiter_fifo(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await take(store, "h1")
    for n in range(3):
        await wait(store, f"w{n}")
    assert (await store.tick("r1")).granted == ()  # the node is full
    assert (await store.cancel("h1")).cancelled
    # The cancel granted it: the slot is reserved for w0, so the node stays full.
    assert await held(redis, store) == [b"g:w0"]
    assert (await store.tick("r1")).granted == ("w0",)
    claimed = await store.admit(cold("h-w0"), claim="w0")
    assert (claimed.outcome, claimed.node) == ("admit", "n1")
    assert await held(redis, store) == [b"h:h-w0"]
    order = []
    for hold in ("h-w0", "h-w1"):
        await store.cancel(hold)
        (granted,) = (await store.tick("r1")).granted
        order.append(granted)
        await store.admit(cold(f"h-{granted}"), claim=granted)
    assert order == ["w1", "w2"]


async def test_outsiders_do_not_take_a_slot_its_waiters_wait_for(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await take(store, "h1")
    await wait(store, "w1")
    # The hold expires: its slot is free with no script run, but it is w1's.
    await store.set_test_clock(NOW + HOLD_MS + 1)
    outsider = await store.admit(cold("h-out"))
    assert outsider.outcome == "refuse"
    assert outsider.results[PolicyName.SLOTS].detail == "waiters first"
    # The tick's sweep frees it and grants it.
    assert (await store.tick("r1")).granted == ("w1",)
    assert (await store.admit(cold("h-w1"), claim="w1")).outcome == "admit"
    assert await slot_queue_keys(redis, store.keys.prefix) == []
    # No waiter left: the node is open to every call again.
    await store.cancel("h-w1")
    assert (await store.admit(cold("h-next"))).outcome == "admit"


async def test_a_released_sandbox_and_a_moved_commit_grant_their_slots(
    store: AdmissionStore,
) -> None:
    await take(store, "h1")
    assert await store.commit("h1")
    await wait(store, "w1")
    assert await store.release("sb-h1")
    assert (await store.tick("r1")).granted == ("w1",)
    assert (await store.admit(cold("h-w1"), claim="w1")).outcome == "admit"
    assert await store.commit("h-w1")
    # sb-h-w1 runs on n1; n2 is full too; its next hold moves it to n2.
    await take(store, "h2", [("n2", 2)])
    await wait(store, "w2")
    moved = await store.admit(AdmitArgs("h3", "acme", "sb-h-w1", SLOTS_ONLY, nodes=[("n2", 2)]))
    assert moved.node == "n2"
    assert await store.commit("h3")  # frees n1's slot: w2's
    assert (await store.tick("r1")).granted == ("w2",)


async def test_a_waiter_of_two_nodes_is_granted_one_slot_once(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    both = [("n1", 1), ("n2", 1)]
    await take(store, "h1", both)
    await take(store, "h2", both)
    await wait(store, "w1", nodes=both)
    await store.cancel("h2")  # n2's slot: w1's
    assert await held(redis, store, "n2") == [b"g:w1"]
    await store.cancel("h1")  # n1's: no one waits there any more
    assert await held(redis, store, "n1") == []
    assert (await store.tick("r1")).granted == ("w1",)
    claimed = await store.admit(cold("h-w1", both), claim="w1")
    assert (claimed.outcome, claimed.node) == ("admit", "n1")  # the first free candidate
    # Its decision took n1's slot, not the one reserved on n2: that one is free.
    assert await held(redis, store, "n2") == []
    assert await slot_queue_keys(redis, store.keys.prefix) == []


async def test_a_grant_not_used_goes_to_the_next_waiter(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await take(store, "h1")
    for n in range(3):
        await wait(store, f"w{n}")
    await store.cancel("h1")
    assert (await store.tick("r1")).granted == ("w0",)
    # w0's caller left: its grant passes on at once.
    assert await store.leave("w0") == (True, 0.0)
    assert await held(redis, store) == [b"g:w1"]
    # w1's claim expires unclaimed: the sweep passes it on.
    await store.set_test_clock(NOW + 2_001)
    tick = await store.tick("r1")
    assert (tick.granted, tick.swept) == (("w2",), 1)  # w1 holds nothing now
    assert await held(redis, store) == [b"g:w2"]


async def test_a_dead_replicas_slot_waiters_are_dropped_never_granted(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await take(store, "h1")
    await store.enqueue("dead", "acme", "r-dead", 60_000, TTL, N1)
    await wait(store, "live", key="other")
    await store.set_test_clock(NOW + 3_001)  # r-dead's owner entry has expired
    await store.tick("r1")
    await store.cancel("h1")
    assert (await store.tick("r1")).granted == ("live",)
    assert await redis.hlen(store.keys.queue_info) == 1  # "live" alone, granted
    assert await store.leave("live") == (True, 0.0)
    assert await held(redis, store) == []
    assert await slot_queue_keys(redis, store.keys.prefix) == []


async def test_keys_share_a_nodes_slots_by_weight_fifo_within_each(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await LimitsStore(redis, store.keys.prefix).set_key("gold", Limits(weight=3))
    await take(store, "h0")
    for n in range(12):
        await wait(store, f"heavy-{n}", key="heavy")
    for n in range(12):
        await wait(store, f"gold-{n}", key="gold")
    order: list[str] = []
    hold = "h0"
    for _ in range(12):
        await store.cancel(hold)
        (granted,) = (await store.tick("r1")).granted
        order.append(granted)
        hold = f"h-{granted}"
        assert (await store.admit(cold(hold), claim=granted)).outcome == "admit"
        assert len(await held(redis, store)) == 1  # never past the node's one slot
    assert Counter(w.rsplit("-", 1)[0] for w in order) == {"heavy": 3, "gold": 9}
    for key in ("heavy", "gold"):
        mine = [int(w.rsplit("-", 1)[1]) for w in order if w.startswith(key)]
        assert mine == list(range(len(mine)))


async def test_an_expired_slot_waiter_is_swept_from_every_nodes_queue(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    both = [("n1", 1), ("n2", 1)]
    await take(store, "h1", both)
    await take(store, "h2", both)
    await store.enqueue("short", "acme", "r1", 100, TTL, both)
    await store.set_test_clock(NOW + 101)
    tick = await store.tick("r1")
    assert (tick.swept, tick.waiters) == (1, 0)
    assert await slot_queue_keys(redis, store.keys.prefix) == []
    await store.cancel("h1")
    assert await held(redis, store, "n1") == []


async def test_a_slot_waiters_estimate_follows_the_nodes_recent_grant_pace(
    store: AdmissionStore,
) -> None:
    """A node's slots free when sandboxes stop, at no known rate: the estimate is
    the node's recent pace (a grant every second here) times the waiter's place,
    and none before any grant."""
    await take(store, "h0", TWO_SLOTS)
    await take(store, "h1", TWO_SLOTS)
    queued = await store.enqueue("w0", "acme", "r1", 60_000, TTL, TWO_SLOTS)
    assert queued.estimated_wait_ms == -1  # no grant yet: no pace to go by
    await store.enqueue("w1", "acme", "r1", 60_000, TTL, TWO_SLOTS)
    await store.set_test_clock(NOW + 1_000)
    await store.cancel("h0")  # w0 granted after 1 s
    await store.set_test_clock(NOW + 2_000)
    await store.cancel("h1")  # w1 granted 1 s later
    for n in (2, 3, 4):
        await store.enqueue(f"w{n}", "acme", "r1", 60_000, TTL, TWO_SLOTS)
    # w4 is third in line: three grants at one a second.
    assert (await store.queue_position("w4")).estimated_wait_ms == 3_000
    assert (await store.queue_position("w2")).estimated_wait_ms == 1_000


async def test_a_slot_waiter_of_two_nodes_is_estimated_at_the_sooner_node(
    store: AdmissionStore,
) -> None:
    two = [("n1", 1), ("n2", 1)]
    await take(store, "h1", [("n1", 1)])
    await take(store, "h2", [("n2", 1)])
    await store.enqueue("slow", "acme", "r1", 60_000, TTL, [("n1", 1)])
    await store.enqueue("fast", "acme", "r1", 60_000, TTL, [("n2", 1)])
    await store.set_test_clock(NOW + 250)
    await store.cancel("h2")  # n2: a grant after 250 ms
    await store.set_test_clock(NOW + 1_000)
    await store.cancel("h1")  # n1: a grant after 1 s
    # Both grants are still unclaimed (their slots reserved): "both" waits.
    queued = await store.enqueue("both", "acme", "r1", 60_000, TTL, two)
    assert queued.estimated_wait_ms == 250
