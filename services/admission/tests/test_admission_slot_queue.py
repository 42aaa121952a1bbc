"""Node-slot queuing through the real Admit gRPC path, on real Redis with real
concurrency (SPEC Q1): cold creates that only a node's slots refuse wait for a
slot and are admitted as slots free (a cancel, a release), never past the node's
slots, each once, FIFO within a client; a waiter that gives up or whose replica
died leaves nothing behind."""

from __future__ import annotations

import asyncio
from functools import partial
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from turnstile_admission.redis_store import AdmissionStore
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_testing.eventually import eventually

if TYPE_CHECKING:
    from conftest import QueueProbe

ADMITTED = admission_pb2.DECISION_ADMITTED
REFUSED = admission_pb2.DECISION_REFUSED
SLOTS = 3


def settings(slots: int = SLOTS) -> dict[str, Any]:
    return {
        "client_allowlist": ("acme", "l1", "l2", "l3"),
        "rpc_timeout_s": 60,
        "rate": {"default_rate_per_s": 1000, "default_burst": 1000},
        "concurrency": {"default_limit": 10_000},
        "cap": {"default_cap": 10_000},
        "slots": {"per_node": {"n1": slots, "n2": 1}},
        "queue": {"tick_interval_s": 0.01},
    }


def cold(
    sandbox_id: str, client_id: str = "acme", wait_s: float = 0.0, nodes: tuple[str, ...] = ("n1",)
) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id=client_id),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
        candidate_nodes=nodes,
    )
    if wait_s:
        request.wait_budget.FromMilliseconds(round(wait_s * 1000))
    return request


@pytest.mark.redis_topologies("single", "cluster")
async def test_a_burst_of_waiters_never_holds_more_than_the_nodes_slots(
    start_admission: Any, queue: QueueProbe
) -> None:
    """20 concurrent cold creates for n1's 3 slots: each admitted call commits and
    then stops (ReleaseSandbox), freeing its slot for the next. A concurrent
    watcher reads n1's slots the whole time: never more than 3."""
    running = await start_admission(**settings())

    async def activate(n: int) -> admission_pb2.AdmitResponse:
        request = cold(f"sb-{n}", f"l{n % 3 + 1}", 30)
        answer: admission_pb2.AdmitResponse = await running.stub.Admit(request, timeout=40)
        assert answer.decision == ADMITTED, answer.message
        await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=answer.hold_id))
        await running.stub.ReleaseSandbox(admission_pb2.ReleaseSandboxRequest(sandbox_id=f"sb-{n}"))
        return answer

    burst = asyncio.gather(*(activate(n) for n in range(20)))
    most, answers = await queue.peak(running.keys.slots("n1"), burst)
    assert 1 <= most <= SLOTS
    assert len({a.hold_id for a in answers}) == 20  # no waiter granted twice
    assert {a.node for a in answers} == {"n1"}
    assert sum(a.HasField("waited") for a in answers) >= 20 - SLOTS
    assert await eventually(queue.empty)


async def test_fifo_within_a_client(start_admission: Any, queue: QueueProbe) -> None:
    running = await start_admission(**settings(slots=1))
    first = await running.stub.Admit(cold("sb-first"))
    assert first.decision == ADMITTED

    async def cancel(hold_id: str) -> None:
        # Each cancel frees the one slot; the next waiter in line gets it.
        await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=hold_id))

    requests = [cold(f"sb-{n}", wait_s=20) for n in range(6)]
    order, last = await queue.served_in_order(running.stub, requests, first.hold_id, cancel)
    assert order == [f"sb-{n}" for n in range(6)]
    await cancel(last)
    assert await eventually(queue.empty)
    # Each call is logged once, with its final decision: the refusals it waited
    # out are not (SPEC Q3).
    entries: Any = await queue.redis.xrange(running.keys.decision_stream("acme"))
    logged = [(f[b"sandbox"].decode(), f[b"kind"].decode()) for _, f in entries]
    assert logged == [("sb-first", "admitted"), *((f"sb-{n}", "admitted") for n in range(6))]


async def test_a_waiter_whose_budget_ends_is_refused_and_leaves_nothing(
    start_admission: Any, queue: QueueProbe
) -> None:
    running = await start_admission(**settings(slots=1))
    first = await running.stub.Admit(cold("sb-first"))
    answer = await running.stub.Admit(cold("sb-late", wait_s=0.3), timeout=5)
    assert answer.decision == REFUSED
    assert answer.waited.ToMilliseconds() >= 250
    assert answer.queue_position == 1
    assert "fair queue" in answer.message
    assert await eventually(queue.empty)
    # The slot, freed, is anyone's at once: no waiter holds it.
    await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=first.hold_id))
    assert (await running.stub.Admit(cold("sb-next"))).decision == ADMITTED


async def test_a_cancelled_waiter_of_two_nodes_releases_everything(
    start_admission: Any, queue: QueueProbe
) -> None:
    running = await start_admission(**settings(slots=1))
    both = ("n1", "n2")
    holders = [await running.stub.Admit(cold(f"sb-{n}", nodes=both)) for n in range(2)]
    assert [h.node for h in holders] == ["n1", "n2"]
    call = running.stub.Admit(cold("sb-waiting", wait_s=30, nodes=both), timeout=40)
    await eventually(partial(queue.at_least, 1), what="queued")
    call.cancel()
    assert await eventually(queue.empty)
    for holder in holders:
        await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=holder.hold_id))
    # Both slots are free and no one waits: two calls without a budget take them.
    answers = [await running.stub.Admit(cold(f"sb-out-{n}", nodes=both)) for n in range(2)]
    assert [a.node for a in answers] == ["n1", "n2"]


async def test_a_dead_replicas_slot_waiters_are_dropped_and_the_rest_served(
    start_admission: Any, redis: aioredis.Redis, queue: QueueProbe
) -> None:
    running = await start_admission(**settings(slots=1))
    prefix = running.settings.redis_prefix
    first = await running.stub.Admit(cold("sb-first"))
    # Slot waiters a replica left behind when it died: it never ticks again.
    dead = AdmissionStore(redis, AdmissionSettings(redis_prefix=prefix))
    for n in range(3):
        await dead.enqueue(f"dead-{n}", "acme", "dead-replica", 30_000, 600_000, [("n1", 1)])
    await redis.zadd(f"{prefix}{{adm}}:q:owners", {"dead-replica": 0})  # its lease is over
    call = asyncio.ensure_future(running.stub.Admit(cold("sb-live", "l1", 10), timeout=15))
    await eventually(partial(queue.at_least, 4), what="the live waiter queued")
    await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=first.hold_id))
    answer = await call
    assert answer.decision == ADMITTED, answer.message
    await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=answer.hold_id))
    assert await eventually(queue.empty)


async def test_slots_and_a_client_limit_refusing_together_answer_at_once(
    start_admission: Any,
) -> None:
    running = await start_admission(**{**settings(slots=1), "concurrency": {"default_limit": 1}})
    assert (await running.stub.Admit(cold("sb-first"))).decision == ADMITTED
    answer = await asyncio.wait_for(
        running.stub.Admit(cold("sb-2", wait_s=20), timeout=30), timeout=5
    )
    assert answer.decision == REFUSED
    assert not answer.HasField("waited")
