"""A key-set change made through one replica reaches every other within a second (C2)."""

from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys import Client, KeySet, KeySetError, KeySetStore, KeySetWatcher, Resolver


async def _replica(url: str, prefix: str, poll_s: float = 0.5) -> KeySetWatcher:
    client = aioredis.Redis.from_url(url)
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
