"""The live publisher (SPEC S4): the substrate leader's copy of its reflector's live
sandboxes in Redis, against the API-server emulator and real Redis.

The publisher is leader-only work, ``run(term)``; here it is run directly with a
term the test builds, as the process's leadership would run it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from typing import TYPE_CHECKING

import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys import KeySet, Resolver
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_clientkeys.live_store import Change, FencedError, LiveStore, Op
from turnstile_platform.leader import LeaderTerm
from turnstile_substrate.kubernetes import KubernetesSubstrate
from turnstile_substrate.kubernetes.live_publisher import LivePublisher
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    LABEL_TIER,
    MANAGED_BY,
)
from turnstile_testing.eventually import eventually
from turnstile_testing.kube_emulator import KubeEmulator

if TYPE_CHECKING:
    from conftest import StartSubstrate

NS = "sandboxes"


def seed(kube: KubeEmulator, name: str, client: str = "acme") -> None:
    labels = {
        LABEL_SANDBOX_ID: name,
        LABEL_TIER: "default",
        LABEL_CLIENT_ID: client,
        LABEL_MANAGED_BY: MANAGED_BY,
    }
    kube.create_pod(
        NS,
        {
            "metadata": {"name": name, "labels": labels},
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        },
    )


@contextlib.asynccontextmanager
async def leading(publisher: LivePublisher, term: LeaderTerm) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(publisher.run(term))
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError, FencedError):
            await task


class View:
    def __init__(self, redis: aioredis.Redis, store: LiveStore) -> None:
        self.redis, self.keys = redis, store.keys

    async def live(self, key: str = "acme") -> set[str]:
        return {_s(m) for m in await self.redis.smembers(self.keys.live(key))}

    async def pending(self, key: str = "acme") -> set[str]:
        return {_s(m) for m in await self.redis.zrange(self.keys.pending(key), 0, -1)}

    async def state(self) -> str | None:
        raw = await self.redis.get(self.keys.state)
        return _s(raw) if raw else None

    async def counted(self, live: set[str], key: str = "acme") -> bool:
        return await self.state() == COUNTED and await self.live(key) == live


@pytest.fixture
def store(redis: aioredis.Redis, redis_prefix: str) -> LiveStore:
    return LiveStore(redis, redis_prefix, state_ttl_s=3.0)


@pytest.fixture
def view(redis: aioredis.Redis, store: LiveStore) -> View:
    return View(redis, store)


def publisher_of(sub: KubernetesSubstrate, store: LiveStore, chunk: int = 500) -> LivePublisher:
    return LivePublisher(store, sub.index, sub.reflector, chunk=chunk)


async def test_a_new_leader_resyncs_in_chunks_before_it_marks_the_counts_current(
    kube: KubeEmulator, substrate: StartSubstrate, store: LiveStore, view: View
) -> None:
    for n in range(10):
        seed(kube, f"sb-{n}")
    # What an earlier leader left: one id whose pod is gone, one under a wrong key.
    await store.write(1, [Change(Op.SET, "gone", "acme"), Change(Op.SET, "sb-0", "globex")])
    await store.write(1, state=COUNTED)
    async with substrate(kube) as sub:
        publisher = publisher_of(sub, store, chunk=3)
        async with leading(publisher, LeaderTerm("a", 2)):
            await eventually(lambda: view.counted({f"sb-{n}" for n in range(10)}))
        assert await view.live("globex") == set()
        assert publisher.published == {f"sb-{n}": "acme" for n in range(10)}
        assert publisher.resyncs == 1


async def test_a_pod_first_seen_live_moves_from_pending_to_live_and_leaves_when_gone(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    store: LiveStore,
    view: View,
    redis: aioredis.Redis,
) -> None:
    async with substrate(kube) as sub, leading(publisher_of(sub, store), LeaderTerm("a", 1)):
        await eventually(lambda: view.counted(set()))
        await redis.zadd(store.keys.pending("acme"), {"sb-1": 10**13, "sb-2": 10**13})

        seed(kube, "sb-1")
        await eventually(lambda: view.counted({"sb-1"}))
        assert await view.pending() == {"sb-2"}

        kube.delete_pod(NS, "sb-1")
        await eventually(lambda: view.counted(set()))
        assert await view.pending() == {"sb-2"}


async def test_a_new_key_set_moves_live_pods_to_their_new_key_before_any_renewal(
    kube: KubeEmulator, substrate: StartSubstrate, redis: aioredis.Redis, redis_prefix: str
) -> None:
    store = LiveStore(redis, redis_prefix, state_ttl_s=30.0)  # renewed every 10 s
    view = View(redis, store)
    resolver = Resolver(KeySet(version=1, allowlist=frozenset({"acme"})))
    seed(kube, "sb-g", client="globex")
    async with substrate(kube, resolver=resolver) as sub:
        work = asyncio.ensure_future(sub.live_counts_work(store, 500)(LeaderTerm("a", 1)))
        try:
            await eventually(lambda: view.counted({"sb-g"}, key="shared"))  # not allowlisted

            # ``keys allow globex``: the key-set watcher swaps the resolver, tells the substrate.
            resolver.swap(KeySet(version=2, allowlist=frozenset({"acme", "globex"})))
            sub.key_set_changed()

            # Long before the publisher's 10 s renewal: globex's cap counts sb-g now.
            await eventually(lambda: view.counted({"sb-g"}, key="globex"), timeout_s=5)
            assert await view.live("shared") == set()
        finally:
            work.cancel()
            with contextlib.suppress(asyncio.CancelledError, FencedError):
                await work


async def test_a_leader_behind_withdraws_the_counts_until_it_has_resynced(
    kube: KubeEmulator, substrate: StartSubstrate, store: LiveStore, view: View
) -> None:
    seed(kube, "sb-1")
    async with substrate(kube) as sub:
        publisher = publisher_of(sub, store)
        async with leading(publisher, LeaderTerm("a", 1)):
            await eventually(lambda: view.counted({"sb-1"}))
            # The watch is cut and every re-list fails: the cache falls behind.
            kube.inject_failure(503, method="GET", watch=False, times=10_000)
            await kube.wait_for_watches(1)
            kube.cut_watches()
            seed(kube, "sb-2")
            await eventually(lambda: _is(view.state(), None))
            assert not sub.reflector.current

            kube.clear_failures()
            await eventually(lambda: view.counted({"sb-1", "sb-2"}))
            assert publisher.resyncs == 2


async def test_a_410_makes_the_counts_unknown_until_the_relist(
    kube: KubeEmulator, substrate: StartSubstrate, store: LiveStore, view: View
) -> None:
    async with substrate(kube) as sub:
        publisher = publisher_of(sub, store)
        async with leading(publisher, LeaderTerm("a", 1)):
            await eventually(lambda: view.counted(set()))
            lists = sub.reflector.lists
            # The re-list after the 410 is refused a while, so the gap is observable.
            kube.inject_failure(503, method="GET", watch=False, times=10_000)
            kube.inject_failure(410, watch=True)
            await kube.wait_for_watches(1)
            kube.end_watches()
            await eventually(lambda: _is(view.state(), None))
            kube.clear_failures()
            seed(kube, "sb-1")
            await sub.reflector.wait_until(lambda: sub.reflector.lists > lists, 10)
            await eventually(lambda: view.counted({"sb-1"}))


async def test_live_counts_redis_lost_are_republished_before_they_are_marked_current(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    store: LiveStore,
    view: View,
    redis: aioredis.Redis,
) -> None:
    """Redis restarted without its data (or failed over to a replica that lacked the
    writes): the leader's next write finds its epoch gone, and the marker comes back
    only over the republished sets — a renewal over empty ones would let the cap count
    no live sandbox until the next re-list."""
    for n in range(3):
        seed(kube, f"sb-{n}")
    live = {f"sb-{n}" for n in range(3)}
    async with substrate(kube) as sub:
        publisher = publisher_of(sub, store)
        async with leading(publisher, LeaderTerm("a", 1)):
            await eventually(lambda: view.counted(live))
            k = store.keys
            await redis.delete(k.epoch, k.sandboxes, k.state, k.live("acme"))  # all of it
            await eventually(lambda: _is(view.state(), COUNTED))
            assert await view.live() == live
            assert publisher.resyncs == 2


async def test_a_deposed_leader_is_fenced_by_redis_and_stops(
    kube: KubeEmulator, substrate: StartSubstrate, store: LiveStore, view: View
) -> None:
    async with substrate(kube) as sub:
        old = publisher_of(sub, store)
        async with leading(old, LeaderTerm("a", 1)) as old_task:
            await eventually(lambda: view.counted(set()))
            # A new leader takes over (epoch 2) while the old one still runs.
            await store.write(2, [Change(Op.SET, "from-new", "acme")])
            seed(kube, "sb-1")  # the old one tries to publish it
            with pytest.raises(FencedError):
                async with asyncio.timeout(10):
                    await old_task
        assert await view.live() == {"from-new"}


def _s(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


async def _is(value: Awaitable[str | None], expected: str | None) -> bool:
    return await value == expected
