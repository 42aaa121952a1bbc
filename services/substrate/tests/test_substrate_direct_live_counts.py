"""The Direct substrate counting its own runtimes (SPEC S4): real processes, real
Redis, the same store the Kubernetes leader publishes to and admission reads."""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys import KeySet, Resolver
from turnstile_clientkeys.live_counts import COUNTED, UNSUPPORTED
from turnstile_clientkeys.live_store import LiveStore
from turnstile_platform.leader import LeaderTerm
from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.runtime import CountUnknown, LiveCount, RuntimeSpec
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.eventually import eventually

IDLE = f"{sys.executable} -m turnstile_substrate.direct.idle_runtime"


async def no_gate() -> None:
    return None


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def spec(sandbox_id: str, label: str | None) -> RuntimeSpec:
    return RuntimeSpec(sandbox_id=sandbox_id, tier="", client_label=label)


class Published:
    """What admission reads: the live sets and the marker, straight from Redis."""

    def __init__(self, redis: aioredis.Redis, store: LiveStore) -> None:
        self.redis, self.keys = redis, store.keys

    async def live(self, key: str) -> set[str]:
        return {_s(m) for m in await self.redis.smembers(self.keys.live(key))}

    async def pending(self, key: str) -> set[str]:
        return {_s(m) for m in await self.redis.zrange(self.keys.pending(key), 0, -1)}

    async def live_is(self, key: str, expected: set[str]) -> bool:
        return await self.live(key) == expected

    async def state(self) -> str:
        return _s(await self.redis.get(self.keys.state) or b"")

    async def state_is(self, expected: str) -> bool:
        return await self.state() == expected


@pytest.fixture
def resolver() -> Resolver:
    return Resolver(KeySet(version=1, allowlist=frozenset({"acme"})))


@pytest.fixture
async def counting(
    tmp_path: Path, redis: aioredis.Redis, redis_prefix: str, resolver: Resolver
) -> AsyncIterator[tuple[DirectSubstrate, Published]]:
    settings = SubstrateSettings(
        direct_state_dir=tmp_path / "direct",
        direct_runtime_command=IDLE,
        direct_runtime_user=str(os.getuid()),  # about counts, not uids
        affinity_addr="127.0.0.1:50999",
        direct_live_counts="count",
    )
    substrate = DirectSubstrate(settings, resolver=resolver)
    await substrate.start()
    store = LiveStore(redis, redis_prefix, state_ttl_s=30)
    work = asyncio.ensure_future(substrate.live_counts_work(store, 2)(LeaderTerm("me", 1)))
    try:
        yield substrate, Published(redis, store)
    finally:
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work
        for sandbox_id in ("sb-1", "sb-2", "sb-3"):
            await substrate.stop_runtime(sandbox_id)
        await substrate.close()


async def test_each_runtime_is_published_under_its_clients_key_and_leaves_pending(
    counting: tuple[DirectSubstrate, Published], redis: aioredis.Redis
) -> None:
    substrate, published = counting
    # Admission admitted sb-1 for acme: it is pending until the substrate counts it.
    await redis.zadd(published.keys.pending("acme"), {"sb-1": 2**40})

    for sandbox_id, label in (("sb-1", "acme"), ("sb-2", "acme"), ("sb-3", "globex")):
        await substrate.ensure_runtime(
            spec(sandbox_id, label), substrate.plan(spec(sandbox_id, label)), no_gate
        )

    await eventually(lambda: published.live_is("acme", {"sb-1", "sb-2"}))
    await eventually(lambda: published.live_is("shared", {"sb-3"}))  # not allowlisted
    assert await published.pending("acme") == set()
    assert await published.state() == COUNTED
    assert substrate.count_live("acme", "sb-1", ["sb-1", "sb-2"]) == LiveCount(
        1, frozenset({"sb-2"})
    )


async def test_a_stopped_runtime_leaves_its_keys_live_set(
    counting: tuple[DirectSubstrate, Published],
) -> None:
    substrate, published = counting
    for sandbox_id in ("sb-1", "sb-2"):
        await substrate.ensure_runtime(
            spec(sandbox_id, "acme"), substrate.plan(spec(sandbox_id, "acme")), no_gate
        )
    await eventually(lambda: published.live_is("acme", {"sb-1", "sb-2"}))

    await substrate.stop_runtime("sb-1")

    await eventually(lambda: published.live_is("acme", {"sb-2"}))
    assert substrate.count_live("acme", None, []) == LiveCount(1)


async def test_a_new_key_set_moves_live_runtimes_to_their_new_key_before_any_renewal(
    counting: tuple[DirectSubstrate, Published], resolver: Resolver
) -> None:
    substrate, published = counting
    await substrate.ensure_runtime(
        spec("sb-3", "globex"), substrate.plan(spec("sb-3", "globex")), no_gate
    )
    await eventually(lambda: published.live_is("shared", {"sb-3"}))  # not allowlisted yet

    # ``keys allow globex``: the key-set watcher swaps the resolver and tells the substrate.
    resolver.swap(KeySet(version=2, allowlist=frozenset({"acme", "globex"})))
    substrate.key_set_changed()

    # The publisher renews every 10 s (a third of the marker's 30 s); the move comes
    # long before, so globex's cap counts sb-3 from its next activation on.
    await eventually(lambda: published.live_is("globex", {"sb-3"}), timeout_s=5)
    assert await published.live("shared") == set()
    assert substrate.count_live("globex", None, []) == LiveCount(1)


def test_unsupported_stays_the_default_and_answers_unknown(tmp_path: Path) -> None:
    settings = SubstrateSettings(
        direct_state_dir=tmp_path, direct_runtime_command=IDLE, direct_runtime_user=str(os.getuid())
    )
    assert settings.direct_live_counts == "unsupported"
    count = DirectSubstrate(settings).count_live("acme", None, [])
    assert isinstance(count, CountUnknown)
    assert count.reason == "unsupported"


async def test_unsupported_declares_so_in_the_store(
    tmp_path: Path, redis: aioredis.Redis, redis_prefix: str
) -> None:
    settings = SubstrateSettings(
        direct_state_dir=tmp_path, direct_runtime_command=IDLE, direct_runtime_user=str(os.getuid())
    )
    store = LiveStore(redis, redis_prefix, state_ttl_s=30)
    work = asyncio.ensure_future(
        DirectSubstrate(settings).live_counts_work(store, 10)(LeaderTerm("me", 1))
    )
    try:
        await eventually(lambda: Published(redis, store).state_is(UNSUPPORTED))
    finally:
        work.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await work


def test_counting_without_the_resolver_is_refused(tmp_path: Path) -> None:
    settings = SubstrateSettings(
        direct_state_dir=tmp_path,
        direct_runtime_command=IDLE,
        direct_runtime_user=str(os.getuid()),
        direct_live_counts="count",
    )
    with pytest.raises(ValueError, match="resolver"):
        DirectSubstrate(settings)
