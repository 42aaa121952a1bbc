"""Per-client queuing through the real Admit gRPC path, on real Redis with real
concurrency (SPEC Q1): with ``queue_per_client`` a call that only its own limits
refuse waits, FIFO among its key's waiters, and is admitted when its key has
room again (a lease released, its bucket refilled, a sandbox seen gone), never
past its limits; without it such a refusal is answered at once; a waiter whose
budget ends leaves nothing."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys.limits import Limits, LimitsStore
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_clientkeys.live_store import Change, LiveStore, Op
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_testing.eventually import eventually

if TYPE_CHECKING:
    from conftest import QueueProbe

ADMITTED = admission_pb2.DECISION_ADMITTED
REFUSED = admission_pb2.DECISION_REFUSED


def settings() -> dict[str, Any]:
    return {
        "client_allowlist": ("acme",),
        "rpc_timeout_s": 60,
        "rate": {"default_rate_per_s": 1000, "default_burst": 1000},
        "concurrency": {"default_limit": 10_000},
        "cap": {"default_cap": 10_000},
        "queue": {"tick_interval_s": 0.01},
    }


def warm(
    sandbox_id: str, wait_s: float = 0.0, per_client: bool = True
) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id="acme"),
        kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
        queue_per_client=per_client,
    )
    if wait_s:
        request.wait_budget.FromMilliseconds(round(wait_s * 1000))
    return request


@pytest.mark.redis_topologies("single", "cluster")
async def test_a_burst_of_waiters_never_passes_the_clients_concurrency(
    start_admission: Any, redis: aioredis.Redis, queue: QueueProbe
) -> None:
    """12 concurrent calls of one client with a concurrency of 2: each admitted
    call commits (its lease released), letting the next in. A concurrent watcher
    reads the key's leases the whole time: never more than 2."""
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    await LimitsStore(redis, prefix).set_key("acme", Limits(concurrency=2))

    async def activate(n: int) -> str:
        answer: admission_pb2.AdmitResponse = await running.stub.Admit(
            warm(f"sb-{n}", 20), timeout=30
        )
        assert answer.decision == ADMITTED, answer.message
        await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=answer.hold_id))
        return str(answer.hold_id)

    burst = asyncio.gather(*(activate(n) for n in range(12)))
    most, holds = await queue.peak(running.keys.inflight("acme"), burst)
    assert 1 <= most <= 2
    assert len(set(holds)) == 12  # no waiter granted twice
    assert await eventually(queue.empty)


async def test_fifo_within_a_client(
    start_admission: Any, redis: aioredis.Redis, queue: QueueProbe
) -> None:
    running = await start_admission(**settings())
    await LimitsStore(redis, queue.prefix).set_key("acme", Limits(concurrency=1))
    first = await running.stub.Admit(warm("sb-first"))
    assert first.decision == ADMITTED

    async def commit(hold_id: str) -> None:
        # Each commit releases the one lease; the next waiter in line gets it.
        await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=hold_id))

    requests = [warm(f"sb-{n}", 20) for n in range(6)]
    order, _ = await queue.served_in_order(running.stub, requests, first.hold_id, commit)
    assert order == [f"sb-{n}" for n in range(6)]


async def test_without_queue_per_client_an_own_limit_answers_at_once(
    start_admission: Any, redis: aioredis.Redis, queue: QueueProbe
) -> None:
    running = await start_admission(**settings())
    await LimitsStore(redis, running.settings.redis_prefix).set_key("acme", Limits(concurrency=1))
    assert (await running.stub.Admit(warm("sb-first"))).decision == ADMITTED
    answer = await asyncio.wait_for(
        running.stub.Admit(warm("sb-2", 20, per_client=False), timeout=30), timeout=5
    )
    assert answer.decision == REFUSED
    assert not answer.HasField("waited")


async def test_a_waiter_whose_budget_ends_is_refused_and_leaves_nothing(
    start_admission: Any, redis: aioredis.Redis, queue: QueueProbe
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    await LimitsStore(redis, prefix).set_key("acme", Limits(concurrency=1))
    first = await running.stub.Admit(warm("sb-first"))
    answer = await running.stub.Admit(warm("sb-late", 0.3), timeout=5)
    assert answer.decision == REFUSED
    assert answer.waited.ToMilliseconds() >= 250
    assert "fair queue" in answer.message
    assert await eventually(queue.empty)
    await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=first.hold_id))
    assert (await running.stub.Admit(warm("sb-next"))).decision == ADMITTED


async def test_a_cap_waiter_is_admitted_when_the_substrate_sees_a_sandbox_go(
    start_admission: Any, redis: aioredis.Redis, queue: QueueProbe
) -> None:
    """The live set is written by the substrate leader's own script (LiveStore,
    live_publish.lua): a sandbox it sees go makes room under the cap, and the
    waiter is admitted (SPEC Q1, S4)."""
    running = await start_admission(**settings())
    await LimitsStore(redis, queue.prefix).set_key("acme", Limits(cap=1))
    leader = LiveStore(redis, queue.prefix, state_ttl_s=60)
    await leader.write(1, [Change(Op.SET, "sb-running", "acme")], COUNTED)
    call = asyncio.ensure_future(running.stub.Admit(warm("sb-new", 20), timeout=30))
    await eventually(partial(queue.at_least, 1), what="the waiter queued")
    assert not call.done()
    await leader.write(1, [Change(Op.DEL, "sb-running", "acme")], COUNTED, continuing=True)
    answer = await call
    assert answer.decision == ADMITTED, answer.message
    assert answer.HasField("waited")
    assert await eventually(queue.empty)


async def test_bucket_waiters_are_admitted_as_the_clients_bucket_refills_never_past_it(
    start_admission: Any, redis: aioredis.Redis, queue: QueueProbe
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    rate = 10.0
    await LimitsStore(redis, prefix).set_key("acme", Limits(rate=rate, burst=1))
    loop = asyncio.get_running_loop()
    started = loop.time()
    done: list[float] = []

    async def activate(n: int) -> None:
        answer = await running.stub.Admit(warm(f"sb-{n}", 20), timeout=30)
        assert answer.decision == ADMITTED, answer.message
        done.append(loop.time() - started)

    await asyncio.gather(*(activate(n) for n in range(8)))
    # Burst 1 then 10 a second: by time t at most 1 + 10 t admitted (50 ms allowed
    # for this process's clock against Redis's).
    for n, t in enumerate(sorted(done)):
        assert n + 1 <= 1 + rate * (t + 0.05), (n, t)
    # Each call logged once, with its final decision (SPEC Q3).
    entries: Any = await redis.xrange(running.keys.decision_stream("acme"))
    assert sorted(f[b"sandbox"].decode() for _, f in entries) == [f"sb-{n}" for n in range(8)]
    assert await eventually(queue.empty)


async def test_a_cancelled_waiter_releases_everything(
    start_admission: Any, redis: aioredis.Redis, queue: QueueProbe
) -> None:
    running = await start_admission(**settings())
    await LimitsStore(redis, queue.prefix).set_key("acme", Limits(concurrency=1))
    first = await running.stub.Admit(warm("sb-first"))
    call = running.stub.Admit(warm("sb-waiting", 30), timeout=40)
    await eventually(partial(queue.at_least, 1), what="queued")
    call.cancel()
    assert await eventually(queue.empty)
    # The lease released, a call without a budget takes it: nothing was kept.
    await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=first.hold_id))
    assert (await running.stub.Admit(warm("sb-next"))).decision == ADMITTED
