"""``live_publish.lua`` against real Redis: the one write to the live counts
admission's cap reads (SPEC S4): pending → live in one step, removal, the
marker, and fencing by the leader's epoch."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys import LiveCountKeys
from turnstile_clientkeys.live_counts import COUNTED, UNSUPPORTED
from turnstile_clientkeys.live_store import (
    DROP,
    Change,
    FencedError,
    LiveStore,
    Op,
    StateLostError,
)


@pytest.fixture
def store(redis: aioredis.Redis, redis_prefix: str) -> LiveStore:
    return LiveStore(redis, redis_prefix, state_ttl_s=5.0)


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def members(raw: set[bytes | str]) -> set[str]:
    return {_s(m) for m in raw}


async def test_set_moves_the_id_from_the_pending_set_to_the_live_set_in_one_step(
    store: LiveStore, redis: aioredis.Redis
) -> None:
    k: LiveCountKeys = store.keys
    await redis.zadd(k.pending("acme"), {"sb-1": 10**13, "sb-2": 10**13})

    added = await store.write(1, [Change(Op.SET, "sb-1", "acme")])

    assert added == 1
    assert members(await redis.smembers(k.live("acme"))) == {"sb-1"}
    assert [_s(m) for m in await redis.zrange(k.pending("acme"), 0, -1)] == ["sb-2"]
    assert await redis.hget(k.sandboxes, "sb-1") == b"acme"
    assert await store.write(1, [Change(Op.SET, "sb-1", "acme")]) == 0  # idempotent


async def test_del_removes_the_id_from_its_keys_live_set_and_the_index(
    store: LiveStore, redis: aioredis.Redis
) -> None:
    k = store.keys
    await store.write(1, [Change(Op.SET, "sb-1", "acme"), Change(Op.SET, "sb-2", "acme")])

    removed = await store.write(1, [Change(Op.DEL, "sb-1", "acme")])

    assert removed == 1
    assert members(await redis.smembers(k.live("acme"))) == {"sb-2"}
    assert await redis.hget(k.sandboxes, "sb-1") is None


async def test_a_sandbox_recharged_to_another_key_moves_between_live_sets(
    store: LiveStore, redis: aioredis.Redis
) -> None:
    k = store.keys
    await store.write(1, [Change(Op.SET, "sb-1", "acme")])

    await store.write(1, [Change(Op.DEL, "sb-1", "acme"), Change(Op.SET, "sb-1", "shared")])

    assert await redis.scard(k.live("acme")) == 0
    assert members(await redis.smembers(k.live("shared"))) == {"sb-1"}
    assert await redis.hget(k.sandboxes, "sb-1") == b"shared"


async def test_the_marker_is_set_with_its_ttl_and_dropped(
    store: LiveStore, redis: aioredis.Redis
) -> None:
    k = store.keys
    await store.write(1, state=COUNTED)
    assert await redis.get(k.state) == COUNTED.encode()
    assert 0 < await redis.pttl(k.state) <= 5000

    await store.write(1, state=UNSUPPORTED)
    assert await redis.get(k.state) == UNSUPPORTED.encode()

    await store.write(1, state=DROP)
    assert await redis.get(k.state) is None


async def test_a_write_from_an_older_epoch_is_refused_whole(
    store: LiveStore, redis: aioredis.Redis
) -> None:
    k = store.keys
    await store.write(3, [Change(Op.SET, "sb-1", "acme")], state=COUNTED)
    await redis.zadd(k.pending("acme"), {"sb-2": 10**13})

    with pytest.raises(FencedError):
        await store.write(2, [Change(Op.SET, "sb-2", "acme"), Change(Op.DEL, "sb-1", "acme")])
    with pytest.raises(FencedError):
        await store.write(2, state=DROP)

    assert members(await redis.smembers(k.live("acme"))) == {"sb-1"}
    assert await redis.zscore(k.pending("acme"), "sb-2") is not None
    assert await redis.get(k.state) == COUNTED.encode()
    assert await redis.get(k.epoch) == b"3"
    # The same epoch and newer ones still write; a newer one raises the bar.
    await store.write(3, [Change(Op.SET, "sb-2", "acme")])
    await store.write(4)
    with pytest.raises(FencedError):
        await store.write(3)


async def test_a_continuing_write_whose_epoch_redis_lost_applies_nothing(
    store: LiveStore, redis: aioredis.Redis
) -> None:
    """Redis restarted empty (or failed over without the writes): a writer that has
    written in its epoch before finds it gone and changes nothing, not even the
    marker, so it cannot mark sets it never rewrote as current."""
    k = store.keys
    await store.write(3, state=DROP)
    assert await store.write(3, [Change(Op.SET, "sb-1", "acme")], continuing=True) == 1
    await redis.delete(k.epoch, k.sandboxes, k.live("acme"))  # what a restart loses

    with pytest.raises(StateLostError):
        await store.write(3, [Change(Op.SET, "sb-2", "acme")], COUNTED, continuing=True)
    assert await redis.get(k.state) is None
    assert await redis.smembers(k.live("acme")) == set()
    assert await redis.get(k.epoch) is None
    await store.write(3, state=DROP)  # starting over sets it again
    assert await store.write(3, state=COUNTED, continuing=True) == 0


async def test_the_first_leaders_epoch_zero_is_kept_for_its_continuing_writes(
    store: LiveStore, redis: aioredis.Redis
) -> None:
    """A Lease's first term has epoch 0 (no transitions yet): it is written like any
    other, so the same leader's next writes find it and are applied."""
    await store.write(0, state=DROP)
    assert await redis.get(store.keys.epoch) == b"0"
    assert await store.write(0, [Change(Op.SET, "sb-1", "acme")], continuing=True) == 1
    assert await store.write(0, state=COUNTED, continuing=True) == 0
    assert await redis.get(store.keys.state) == COUNTED.encode()


async def test_published_pages_through_every_id(store: LiveStore) -> None:
    changes = [Change(Op.SET, f"sb-{n}", f"key-{n % 7}") for n in range(1200)]
    for start in range(0, len(changes), 400):  # chunked, as a resync writes
        await store.write(1, changes[start : start + 400])

    published = await store.published(page_size=100)

    assert published == {c.sandbox_id: c.key for c in changes}
