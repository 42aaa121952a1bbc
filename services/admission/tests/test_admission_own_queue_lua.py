"""Per-client queuing in the fair queue's scripts, against real Redis on a frozen
clock (SPEC Q1): a call that only its own limits refuse waits in its key's own
queue, FIFO, and is granted when the key has room again: a lease released
(commit, cancel), the key's bucket refilled (a tick), the substrate's live count
dropping (a tick); the grant reserves what the call needs, so the key never
passes its limits; a waiter that leaves or expires gives the reservation back."""

from __future__ import annotations

from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from turnstile_admission.policies import PolicyName
from turnstile_admission.redis_store import AdmissionStore, AdmitArgs, OwnLimits
from turnstile_admission.settings import AdmissionSettings, QueueSettings
from turnstile_clientkeys.limits import Limits, LimitsStore

if TYPE_CHECKING:
    from conftest import LiveSets

NOW = 11_000_000
TTL = 600_000
OWN = {PolicyName.CAP: 2, PolicyName.RATE: 2, PolicyName.CONCURRENCY: 2, PolicyName.SLOTS: 0}
CONCURRENCY = OwnLimits(cap=False, concurrency=True, rate=False)
RATE = OwnLimits(cap=False, concurrency=False, rate=True)
CAP = OwnLimits(cap=True, concurrency=False, rate=False)
ALL = OwnLimits(cap=True, concurrency=True, rate=True)


@pytest.fixture
async def store(redis: aioredis.Redis, redis_prefix: str, live: LiveSets) -> AdmissionStore:
    settings = AdmissionSettings(
        redis_prefix=redis_prefix,
        test_clock=True,
        queue=QueueSettings(claim_ttl_s=2, owner_ttl_s=3),
    )
    store = AdmissionStore(redis, settings)
    await store.set_test_clock(NOW)
    return store


async def limit(redis: aioredis.Redis, store: AdmissionStore, limits: Limits) -> None:
    await LimitsStore(redis, store.keys.prefix).set_key("acme", limits)


def admit(hold: str, sandbox: str | None = None) -> AdmitArgs:
    return AdmitArgs(hold, "acme", sandbox or f"sb-{hold}", OWN)


async def wait(store: AdmissionStore, wid: str, own: OwnLimits, owner: str = "r1") -> None:
    queued = await store.enqueue(wid, "acme", owner, 60_000, TTL, own=own)
    assert queued.queued


async def own_keys(redis: aioredis.Redis, prefix: str) -> list[bytes]:
    keys = [k async for k in redis.scan_iter(match=f"{prefix}{{adm}}:q*")]
    bookkeeping = (b":meta", b":vf", b"q:owners", b"q:ownq", b"q:pace")
    return sorted(k for k in keys if not k.endswith(bookkeeping))


async def test_a_released_lease_goes_to_the_first_waiter_fifo(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await limit(redis, store, Limits(concurrency=1))
    assert (await store.admit(admit("h1"))).outcome == "admit"
    await wait(store, "w0", CONCURRENCY)
    await wait(store, "w1", CONCURRENCY)
    assert (await store.tick("r1")).granted == ()  # the one lease is taken
    assert (await store.cancel("h1")).cancelled
    # The cancel granted w0 its lease: another call of the key finds none.
    assert await redis.zrange(store.keys.inflight("acme"), 0, -1) == [b"g:w0"]
    assert (await store.admit(admit("h-other"))).outcome == "refuse"
    assert (await store.tick("r1")).granted == ("w0",)
    assert (await store.admit(admit("h-w0"), claim="w0")).outcome == "admit"
    assert await redis.zrange(store.keys.inflight("acme"), 0, -1) == [b"h-w0"]
    assert await store.commit("h-w0")  # its lease released: w1's turn
    assert (await store.tick("r1")).granted == ("w1",)
    assert (await store.admit(admit("h-w1"), claim="w1")).outcome == "admit"
    assert await own_keys(redis, store.keys.prefix) == []


async def test_the_keys_bucket_refilling_grants_one_waiter_per_token(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await limit(redis, store, Limits(rate=10, burst=1))  # a token every 100 ms
    assert (await store.admit(admit("h0"))).outcome == "admit"
    for n in range(3):
        await wait(store, f"w{n}", RATE)
    granted: list[str] = []
    for step in (50, 100, 150, 200, 300):
        await store.set_test_clock(NOW + step)
        for wid in (await store.tick("r1")).granted:
            granted.append(wid)
            assert (await store.admit(admit(f"h-{wid}"), claim=wid)).outcome == "admit"
    assert granted == ["w0", "w1", "w2"]


async def test_a_sandbox_seen_gone_makes_room_under_the_cap(
    store: AdmissionStore, redis: aioredis.Redis, live: LiveSets
) -> None:
    await limit(redis, store, Limits(cap=1))
    await live.counted("acme", "sb-running")
    assert (await store.admit(admit("h1"))).outcome == "refuse"
    await wait(store, "w0", CAP)
    assert (await store.tick("r1")).granted == ()
    await live.counted("acme")  # the substrate's leader saw sb-running go
    assert (await store.tick("r1")).granted == ("w0",)
    assert await redis.zrange(store.keys.pending("acme"), 0, -1) == [b"g:w0"]
    claimed = await store.admit(admit("h-w0", "sb-new"), claim="w0")
    assert claimed.outcome == "admit"
    assert await redis.zrange(store.keys.pending("acme"), 0, -1) == [b"sb-new"]


async def test_a_cap_waiter_is_not_granted_past_pending_when_the_substrate_cannot_count(
    store: AdmissionStore, redis: aioredis.Redis, live: LiveSets
) -> None:
    """No live count (Direct's default) leaves pending as the cap's lower bound: a
    waiter is granted when a pending entry goes, not at once."""
    await limit(redis, store, Limits(cap=1))
    await live.unsupported()
    first = await store.admit(admit("h1"))
    assert first.outcome == "admit"
    assert (await store.admit(admit("h2"))).outcome == "refuse"
    await wait(store, "w0", CAP)
    assert (await store.tick("r1")).granted == ()
    assert (await store.cancel("h1")).cancelled  # its pending entry goes with the hold
    assert (await store.tick("r1")).granted == ("w0",)


async def test_a_waiter_is_granted_only_when_every_limit_it_enforces_has_room(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await limit(redis, store, Limits(concurrency=1, rate=10, burst=1))
    assert (await store.admit(admit("h1"))).outcome == "admit"  # the lease and the token
    await wait(store, "w0", ALL)
    await store.set_test_clock(NOW + 100)  # a token back, the lease still taken
    assert (await store.tick("r1")).granted == ()
    await store.commit("h1")
    assert (await store.tick("r1")).granted == ("w0",)
    assert (await store.admit(admit("h-w0"), claim="w0")).outcome == "admit"


async def test_a_grant_left_or_expired_goes_back_and_to_the_next_waiter(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await limit(redis, store, Limits(concurrency=1, rate=10, burst=1))
    assert (await store.admit(admit("h1"))).outcome == "admit"
    for n in range(3):
        await wait(store, f"w{n}", ALL)
    await store.set_test_clock(NOW + 100)
    await store.cancel("h1")  # the lease, and a token (the bucket had refilled one)
    assert (await store.tick("r1")).granted == ("w0",)
    assert await store.leave("w0") == (True, 0.0)  # its caller went: w1's now
    assert await redis.zrange(store.keys.inflight("acme"), 0, -1) == [b"g:w1"]
    # w1 never claims: at its claim's expiry the sweep gives it to w2.
    await store.set_test_clock(NOW + 100 + 2_001)
    tick = await store.tick("r1")
    assert (tick.granted, tick.swept) == (("w2",), 1)
    assert await store.leave("w2") == (True, 0.0)
    assert await redis.zrange(store.keys.inflight("acme"), 0, -1) == []
    assert await own_keys(redis, store.keys.prefix) == []
    # Nothing was kept: a call without a wait takes the lease and the token.
    assert (await store.admit(admit("h-out"))).outcome == "admit"


async def test_a_dead_replicas_waiter_is_dropped_never_granted(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await limit(redis, store, Limits(concurrency=1))
    assert (await store.admit(admit("h1"))).outcome == "admit"
    await wait(store, "dead", CONCURRENCY, owner="r-dead")
    await wait(store, "live", CONCURRENCY)
    await store.set_test_clock(NOW + 3_001)  # r-dead's owner entry has expired
    await store.tick("r1")
    await store.cancel("h1")
    assert (await store.tick("r1")).granted == ("live",)
    assert await redis.hlen(store.keys.queue_info) == 1


async def test_a_bucket_waiters_estimate_is_when_its_keys_bucket_refills_its_turn(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await limit(redis, store, Limits(rate=10, burst=1))  # a token every 100 ms
    assert (await store.admit(admit("h0"))).outcome == "admit"
    estimates = []
    for n in range(3):
        queued = await store.enqueue(f"w{n}", "acme", "r1", 60_000, TTL, own=RATE)
        estimates.append(queued.estimated_wait_ms)
    assert estimates == [100, 200, 300]
    await store.set_test_clock(NOW + 50)
    assert (await store.queue_position("w2")).estimated_wait_ms == 250


async def test_a_lease_waiters_estimate_follows_its_keys_recent_grant_pace(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    """Leases free when sandboxes stop, at no known rate: the estimate is the key's
    recent pace times the waiter's place, none before any grant."""
    await limit(redis, store, Limits(concurrency=1))
    assert (await store.admit(admit("h0"))).outcome == "admit"
    queued = await store.enqueue("w0", "acme", "r1", 60_000, TTL, own=CONCURRENCY)
    assert queued.estimated_wait_ms == -1
    await wait(store, "w1", CONCURRENCY)
    await wait(store, "w2", CONCURRENCY)
    for n, hold in enumerate(("h0", "h-w0"), start=1):
        await store.set_test_clock(NOW + n * 1_000)
        await store.commit(hold)  # a lease freed every second
        granted = f"w{n - 1}"
        assert (await store.tick("r1")).granted == (granted,)
        assert (await store.admit(admit(f"h-{granted}"), claim=granted)).outcome == "admit"
    assert (await store.queue_position("w2")).estimated_wait_ms == 1_000
    queued = await store.enqueue("w3", "acme", "r1", 60_000, TTL, own=CONCURRENCY)
    assert queued.estimated_wait_ms == 2_000


async def test_a_cap_waiters_estimate_is_unknown_with_a_full_bucket_and_no_pace(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    """A full bucket says nothing of when a sandbox stops: a waiter held by its cap
    has no estimate until the key's grants give a pace (not "0 s")."""
    await limit(redis, store, Limits(cap=1, rate=10, burst=5))
    assert (await store.admit(admit("h0"))).outcome == "admit"
    queued = await store.enqueue("w0", "acme", "r1", 60_000, TTL, own=ALL)
    assert queued.estimated_wait_ms == -1
    assert (await store.queue_position("w0")).estimated_wait_ms == -1


async def test_room_freed_between_ticks_goes_to_the_waiters_not_to_a_call_from_outside(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    """The key's bucket refills by itself, with no script to grant it: the next
    decision of the key hands it to the key's queue before judging the call, so a
    call without a wait budget never takes a token a waiter is owed (FIFO)."""
    await limit(redis, store, Limits(rate=10, burst=1))  # a token every 100 ms
    assert (await store.admit(admit("h0"))).outcome == "admit"
    await wait(store, "w0", RATE)
    await store.set_test_clock(NOW + 100)  # one token back; no tick yet
    outsider = await store.admit(admit("h-outsider"))
    assert outsider.outcome == "refuse"
    assert outsider.results[PolicyName.RATE].detail == "client bucket"
    assert (await store.tick("r1")).granted == ("w0",)
    assert (await store.admit(admit("h-w0"), claim="w0")).outcome == "admit"
    # With the queue empty again, the next token is anyone's.
    await store.set_test_clock(NOW + 200)
    assert (await store.admit(admit("h-next"))).outcome == "admit"


async def test_a_dry_run_grants_nothing_to_the_waiters(
    store: AdmissionStore, redis: aioredis.Redis
) -> None:
    await limit(redis, store, Limits(rate=10, burst=1))
    assert (await store.admit(admit("h0"))).outcome == "admit"
    await wait(store, "w0", RATE)
    await store.set_test_clock(NOW + 100)
    await store.admit(AdmitArgs("h-dry", "acme", "sb-dry", OWN, dry_run=True))
    info = await redis.hget(f"{store.keys.prefix}{{adm}}:q:info", "w0")
    assert info is not None
    assert b'"s":"w"' in info  # still waiting: nothing granted
