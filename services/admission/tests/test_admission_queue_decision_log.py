"""The fair queue and the decision log together (SPEC Q1, Q3, Q4): a call that
waits is logged once, with its final decision; a dry run never waits."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import Any

import redis.asyncio as aioredis
from google.protobuf.duration_pb2 import Duration

from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_testing.eventually import eventually

ADMITTED = admission_pb2.DECISION_ADMITTED
REFUSED = admission_pb2.DECISION_REFUSED


def settings() -> dict[str, Any]:
    return {
        "client_allowlist": ("acme",),
        "rpc_timeout_s": 60,
        "rate": {
            "cluster_rate_per_s": 20.0,
            "cluster_burst": 1,
            "default_rate_per_s": 1000,
            "default_burst": 1000,
        },
        "concurrency": {"default_limit": 10_000},
        "cap": {"default_cap": 10_000},
        "queue": {"tick_interval_s": 0.01},
    }


def warm(sandbox_id: str, client_id: str, wait_s: float = 0.0) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id=client_id),
        kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
    )
    if wait_s:
        request.wait_budget.CopyFrom(Duration(seconds=int(wait_s), nanos=int(wait_s % 1 * 1e9)))
    return request


async def waiters(redis: aioredis.Redis, prefix: str) -> int:
    return int(await redis.hlen(f"{prefix}{{adm}}:q:info"))


async def _sandboxes(redis: Any, stream: str) -> list[tuple[str, str]]:
    """The log's entries, oldest first: (sandbox, kind)."""
    return [
        (fields[b"sandbox"].decode(), fields[b"kind"].decode())
        for _, fields in await redis.xrange(stream)
    ]


async def _queued(redis: aioredis.Redis, prefix: str, n: int) -> bool:
    return await waiters(redis, prefix) >= n


async def test_a_granted_waiter_is_logged_once_when_admitted(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    limits = LimitsStore(redis, prefix)
    await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    task = asyncio.ensure_future(running.stub.Admit(warm("sb-waits", "acme", 20), timeout=30))
    await eventually(partial(_queued, redis, prefix, 1), what="the waiter queued")
    # Its refusal on joining was not logged: only the first call's admission is.
    assert await _sandboxes(redis, running.keys.decisions) == [("sb-first", "admitted")]
    await limits.set_cluster(ClusterLimits(rate=20, burst=1))
    answer = await task
    assert answer.decision == ADMITTED, answer.message
    assert answer.HasField("waited")
    assert await _sandboxes(redis, running.keys.decisions) == [
        ("sb-first", "admitted"),
        ("sb-waits", "admitted"),
    ]


async def test_a_waiter_whose_budget_ends_is_logged_once_refused(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    await LimitsStore(redis, prefix).set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    answer = await running.stub.Admit(warm("sb-waits", "acme", 0.3), timeout=10)
    assert answer.decision == REFUSED
    assert answer.HasField("waited")
    assert await _sandboxes(redis, running.keys.decisions) == [
        ("sb-first", "admitted"),
        ("sb-waits", "refused"),
    ]
    assert await waiters(redis, prefix) == 0


async def test_a_dry_run_with_a_wait_budget_is_decided_at_once_and_never_queued(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    await LimitsStore(redis, prefix).set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    request = warm("sb-dry", "acme", 20)
    request.dry_run = True
    answer = await asyncio.wait_for(running.stub.Admit(request, timeout=30), timeout=5)
    assert answer.decision == REFUSED
    assert answer.dry_run
    assert not answer.HasField("waited")
    assert answer.queue_position == 0
    assert await waiters(redis, prefix) == 0
    assert await _sandboxes(redis, running.keys.decisions) == [("sb-first", "admitted")]
