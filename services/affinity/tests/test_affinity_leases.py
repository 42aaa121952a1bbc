"""Leases: capacity-bounded, expiring, and returned on every path (SPEC T7, X6)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_affinity.store import Clock
from turnstile_contracts import affinity_pb2
from turnstile_testing.eventually import eventually
from turnstile_testing.processes import RedisProcess
from turnstile_testing.proxies import ReplyHoldingProxy
from turnstile_testing.redis_topologies import single_server_port

if TYPE_CHECKING:
    from conftest import StartAffinity, StartWorker


async def test_release_lease_returns_the_slot_once(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    service = await affinity(tiers="a")
    await worker(service.address, "a1", "a", capacity=1)
    placed = await service.place("chat", "a")
    assert (await service.workers())["a1"].leases == 1
    wrong = affinity_pb2.ReleaseLeaseRequest(sandbox_id="a2", lease_id=placed.lease_id)
    assert not (await service.stub.ReleaseLease(wrong)).released
    assert await service.release(placed)
    assert not await service.release(placed)
    assert (await service.workers())["a1"].leases == 0
    assert (await service.place("chat", "a")).sandbox_id == "a1"


async def test_an_unreleased_lease_expires_and_frees_its_slot(
    affinity: StartAffinity, worker: StartWorker, redis: aioredis.Redis
) -> None:
    clock = Clock()
    service = await affinity(clock, tiers="a", lease_ttl_s=30, presence_ttl_s=120)
    await worker(service.address, "a1", "a", capacity=1)
    placed = await service.place("chat", "a")
    expires_ms = placed.lease_expires_at.ToMilliseconds()
    assert (await service.refused("chat", "a")).reason == "SANDBOX_BUSY"
    clock.offset_ms += 30_001
    again = await service.place("chat", "a")
    assert again.sandbox_id == "a1"
    assert again.lease_expires_at.ToMilliseconds() > expires_ms
    assert (await service.workers())["a1"].leases == 1
    assert await redis.hlen(service.keys.lease_sandbox) == 1  # the expired one was pruned


async def test_refusals_take_no_lease(affinity: StartAffinity, worker: StartWorker) -> None:
    service = await affinity(tiers="a", grace_s=30)
    a1 = await worker(service.address, "a1", "a", capacity=1)
    await worker(service.address, "a2", "a", capacity=1)
    held = await service.place("chat", "a")
    assert (await service.refused("chat", "a")).reason == "SANDBOX_BUSY"
    other = await service.place("other", "a")
    assert (await service.refused("third", "a")).reason == "TIER_EXHAUSTED"
    assert {w.leases for w in (await service.workers()).values()} == {1}
    await service.release(held)
    await a1.stop()
    assert (await service.refused("chat", "a")).reason == "SANDBOX_PENDING"
    assert (await service.workers())["a2"].leases == 1
    assert await service.release(other)


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[ReplyHoldingProxy]:
    port = single_server_port(redis_url)
    proxy = ReplyHoldingProxy(port)
    await proxy.start()
    yield proxy
    await proxy.close()


async def _until_leases(redis: aioredis.Redis, key: str, count: int) -> None:
    """Wait until Redis itself holds ``count`` leases under ``key``."""

    async def held() -> bool:
        return await redis.zcard(key) == count

    await eventually(held, timeout_s=10, interval_s=0.01, what=f"{count} leases under {key}")


async def test_a_client_cancelling_mid_call_gets_its_lease_returned(
    proxy: ReplyHoldingProxy,
    redis: aioredis.Redis,
    affinity: StartAffinity,
    worker: StartWorker,
) -> None:
    # Long heartbeats: while replies are held, only the Place's own script answers.
    service = await affinity(
        tiers="a",
        redis_url=f"redis://127.0.0.1:{proxy.port}/0",
        redis_timeout_s=10,
        heartbeat_interval_s=30,
        presence_ttl_s=90,
    )
    await worker(service.address, "a1", "a", capacity=4)
    leases = service.keys.leases("a1")
    await service.release(await service.place("chat", "a"))  # the next turn is a hit

    proxy.hold()
    call = service.stub.Place(
        affinity_pb2.PlaceRequest(client_id="acme", session_id="chat", tier="a")
    )
    await _until_leases(redis, leases, 1)  # the script ran and took a lease...
    await asyncio.wait_for(proxy.held.wait(), 10)  # ...and its answer is held back
    proxy.forwarded.clear()
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    # The cancelled handler's lease return is on its way (a new connection's
    # handshake, or the script itself); only now may Redis's answers flow again.
    await asyncio.wait_for(proxy.forwarded.wait(), 10)
    proxy.release()
    await _until_leases(redis, leases, 0)
    assert (await service.workers())["a1"].leases == 0


async def test_redis_unreachable_is_unavailable_and_presence_comes_back_after_a_restart(
    affinity: StartAffinity, worker: StartWorker, private_redis: RedisProcess
) -> None:
    service = await affinity(tiers="a", redis_url=private_redis.url, redis_timeout_s=0.2)
    await worker(service.address, "a1", "a", capacity=4)
    private_redis.stop()
    refusal = await service.refused("chat", "a")
    assert refusal.code == grpc.StatusCode.UNAVAILABLE
    assert refusal.reason == "DEPENDENCY_UNAVAILABLE"
    assert refusal.retryable
    private_redis.start()  # empty: every presence, lease and record is gone
    async with asyncio.timeout(10):  # the worker's next heartbeat puts presence back
        while True:
            with contextlib.suppress(grpc.aio.AioRpcError):
                if "a1" in await service.workers():
                    break
            await asyncio.sleep(0.05)
    assert (await service.place("chat", "a")).sandbox_id == "a1"
