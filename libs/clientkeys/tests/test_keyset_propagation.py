"""A key-set change made through one replica reaches every other within a second (C2)."""

from __future__ import annotations

import asyncio
from typing import cast

import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster
from redis.crc import key_slot

from turnstile_clientkeys import Client, KeySet, KeySetError, KeySetStore, KeySetWatcher, Resolver
from turnstile_testing.redis_topologies import connect


async def _replica(url: str, prefix: str, poll_s: float = 0.5) -> KeySetWatcher:
    client = connect(url)
    watcher = KeySetWatcher(KeySetStore(client, prefix), client, Resolver(), poll_interval_s=poll_s)
    await watcher.start(KeySet(allowlist=frozenset({"seeded"})))
    return watcher


async def _close(*watchers: KeySetWatcher) -> None:
    for watcher in watchers:
        await watcher.stop()
        await watcher._redis.aclose()


async def test_a_change_on_one_replica_is_seen_by_another_within_a_second(
    redis_url: str, redis_prefix: str, redis: aioredis.Redis
) -> None:
    one, two = await _replica(redis_url, redis_prefix), await _replica(redis_url, redis_prefix)
    try:
        assert two.resolver.resolve(Client.of("acme")).key == "shared"
        changed = await one.store.change(allow=("acme",))
        await asyncio.wait_for(two.wait_for_version(changed.version), timeout=1.0)
        key = two.resolver.resolve(Client.of("acme"))
        assert (key.key, key.version) == ("acme", changed.version)
    finally:
        await _close(one, two)


async def test_the_version_check_catches_a_change_whose_message_was_missed(
    redis_url: str, redis_prefix: str, redis: aioredis.Redis
) -> None:
    watcher = await _replica(redis_url, redis_prefix, poll_s=0.2)
    try:
        store = watcher.store
        current = await store.load()
        silent = current.changed(allow=["globex"])
        # Written behind pub/sub's back: only the periodic version check can see it.
        await redis.set(store.doc_key, silent.to_json())
        await redis.set(store.version_key, silent.version)
        await asyncio.wait_for(watcher.wait_for_version(silent.version), timeout=1.0)
        assert watcher.resolver.resolve(Client.of("globex")).key == "globex"
    finally:
        await _close(watcher)


async def test_bootstrap_seeds_from_settings_only_when_redis_has_no_key_set(
    redis_url: str, redis_prefix: str, redis: aioredis.Redis
) -> None:
    store = KeySetStore(redis, redis_prefix)
    first = await store.bootstrap(KeySet(allowlist=frozenset({"a"})))
    assert (first.version, first.allowlist) == (1, frozenset({"a"}))
    second = await store.bootstrap(KeySet(allowlist=frozenset({"b"})))
    assert second == first


async def test_bootstrap_carries_over_a_key_set_stored_before_it_had_a_hash_tag(
    redis: aioredis.Redis, redis_prefix: str
) -> None:
    store = KeySetStore(redis, redis_prefix)
    earlier = KeySet(version=7, allowlist=frozenset({"acme"}), flags={"own_keys": False})
    await redis.set(store.legacy_doc_key, earlier.to_json())
    assert await store.bootstrap(KeySet(allowlist=frozenset({"seeded"}))) == earlier
    assert await store.version() == 7


async def test_changes_apply_on_a_redis_cluster_in_one_slot(
    redis_cluster_client: RedisCluster, redis_prefix: str
) -> None:
    """The document and its version are written in one MULTI: on a cluster they
    must share a slot, or every change fails with CROSSSLOT."""
    store = KeySetStore(cast(aioredis.Redis, redis_cluster_client), redis_prefix)
    assert key_slot(store.doc_key.encode()) == key_slot(store.version_key.encode())
    await store.bootstrap(KeySet(allowlist=frozenset({"a"})))
    results = await asyncio.gather(*(store.change(allow=(f"c{i}",)) for i in range(5)))
    assert sorted(r.version for r in results) == [2, 3, 4, 5, 6]
    assert (await store.load()).allowlist == frozenset({"a", *(f"c{i}" for i in range(5))})
    assert await store.version() == 6


async def test_concurrent_changes_are_all_applied_with_distinct_versions(
    redis: aioredis.Redis, redis_prefix: str
) -> None:
    store = KeySetStore(redis, redis_prefix)
    await store.bootstrap(KeySet())
    results = await asyncio.gather(*(store.change(allow=(f"c{i}",)) for i in range(20)))
    final = await store.load()
    assert final.allowlist == frozenset(f"c{i}" for i in range(20))
    assert sorted(r.version for r in results) == list(range(2, 22))


async def test_an_unknown_flag_is_refused_and_changes_nothing(
    redis: aioredis.Redis, redis_prefix: str
) -> None:
    store = KeySetStore(redis, redis_prefix)
    before = await store.bootstrap(KeySet())
    with pytest.raises(KeySetError, match="unknown flag"):
        await store.change(flags={"nope": True})
    assert await store.load() == before
