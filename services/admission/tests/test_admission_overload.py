"""A fail-open cap never admits past its limit because this replica is overloaded
(issue 10 follow-up; SPEC P1, P6, F3).

The fail mode is for a Redis that is down or hung. When the replica itself
cannot keep up (its event loop starved, more decisions in flight than Redis
connections) a Redis call can spend its budget while Redis answers everyone
else in a millisecond; answering such a call by the fail mode would admit past
the cap. Here the server runs on the test's own event loop beside a task that
burns the CPU every turn, and a few hundred concurrent Admits race for a cap of
7 against real Redis: exactly 7 are admitted, every other answer is a cap
refusal. A call stuck here past the overload wait is refused retryably
(REPLICA_OVERLOADED), never admitted, and its hold is cancelled.
``test_admission_bounded.py`` keeps showing that a paused Redis is still
answered by the fail modes within the budget.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform.errors import decode
from turnstile_testing.proxies import ReplyHoldingProxy

ADMITTED = admission_pb2.DECISION_ADMITTED
CAP = 7
CALLS = 200
#: The Redis budget (the default): Redis answers well within it, the starved
#: loop below does not let every call see its answer within it.
BUDGET_S = 0.5
#: How long each turn of the event loop is held by the burning task, and how
#: often (every STALL_EVERY turns) it holds one for longer than the budget.
BURN_S = 0.002
STALL_EVERY = 40
STALL_S = BUDGET_S * 1.2

SETTINGS: dict[str, Any] = {
    "client_allowlist": ("acme",),
    "redis_timeout_s": BUDGET_S,
    "rate": {"default_burst": 1000, "cluster_burst": 1000},
    "concurrency": {"default_limit": 1000},
    "cap": {"default_cap": CAP},
}


def cold(sandbox_id: str) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id="acme"),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
    )


def slow_decisions() -> float:
    """Decisions so far that took longer than the Redis budget."""
    slow = 0.0
    for decision in ("admitted", "refused"):
        labels = {"decision": decision}
        count = REGISTRY.get_sample_value("turnstile_admission_decision_seconds_count", labels)
        within = REGISTRY.get_sample_value(
            "turnstile_admission_decision_seconds_bucket", {**labels, "le": str(BUDGET_S)}
        )
        slow += (count or 0.0) - (within or 0.0)
    return slow


@contextlib.asynccontextmanager
async def starved_event_loop() -> AsyncIterator[None]:
    """A task on this (the server's) event loop that burns the CPU in every turn
    of it, as a saturated replica's loop is: ``BURN_S`` each turn, and a stall
    longer than the Redis budget every ``STALL_EVERY`` turns (a big batch of
    work, a garbage collection)."""
    stop = asyncio.Event()

    async def burn() -> None:
        turn = 0
        while not stop.is_set():
            turn += 1
            until = time.perf_counter() + (STALL_S if turn % STALL_EVERY == 0 else BURN_S)
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(0)

    task = asyncio.create_task(burn())
    try:
        yield
    finally:
        stop.set()
        await task


async def admit_all(stub: Any, calls: int = CALLS) -> list[Any]:
    async def one(n: int) -> Any:
        try:
            return await stub.Admit(cold(f"sb-{n}"), timeout=60)
        except grpc.aio.AioRpcError as error:
            return error

    return list(await asyncio.gather(*(one(n) for n in range(calls))))


async def test_a_cap_race_on_an_overloaded_replica_admits_exactly_the_cap(
    start_admission: Any,
) -> None:
    running = await start_admission(**SETTINGS)
    slow = slow_decisions()
    async with starved_event_loop():
        answers = await admit_all(running.stub)
    failed = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    assert not failed, failed[:3]
    admitted = [a for a in answers if a.decision == ADMITTED]
    assert len(admitted) == CAP, {v.detail for a in admitted for v in a.verdicts if v.detail}
    assert all(
        v.verdict == admission_pb2.VERDICT_PASS
        for a in admitted
        for v in a.verdicts
        if v.verdict != admission_pb2.VERDICT_SKIPPED
    )
    refused = [a for a in answers if a.decision != ADMITTED]
    assert all(a.refused_by == admission_pb2.POLICY_CAP for a in refused)
    assert all(a.limit == CAP and a.current == CAP for a in refused)
    # The race really ran overloaded: decisions (one script each) outlived the
    # Redis budget, which used to fail them open.
    assert slow_decisions() > slow


async def test_an_admit_stuck_here_past_the_overload_wait_is_refused_retryably_not_admitted(
    start_admission: Any, redis_url: str, redis: aioredis.Redis
) -> None:
    """Calls that need a new connection are stuck in this process (the proxy holds
    the replies of connections opened from now on) while Redis keeps answering
    the connections already open: past the overload wait they are refused
    UNAVAILABLE / REPLICA_OVERLOADED with a retry hint, not failed open, and the
    breaker never hears of them."""
    proxy = ReplyHoldingProxy(int(redis_url.rsplit(":", 1)[1].split("/")[0]))
    await proxy.start()
    overload_wait_s = 0.6
    running = await start_admission(
        **{**SETTINGS, "redis_timeout_s": 0.2},
        redis_url=f"redis://127.0.0.1:{proxy.port}/0",
        overload_wait_s=overload_wait_s,
        health_check_interval_s=0.05,  # others' answers: a PING every 50 ms
    )
    try:
        assert (await running.stub.Admit(cold("sb-warm"))).decision == ADMITTED
        proxy.hold_new()
        started = time.perf_counter()
        answers = await admit_all(running.stub, calls=10)
        seconds = time.perf_counter() - started
    finally:
        proxy.release()
        await proxy.close()
    overloaded = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    decided = [a for a in answers if not isinstance(a, grpc.aio.AioRpcError)]
    assert overloaded, "every call found a connection already open"
    assert seconds >= overload_wait_s
    for error in overloaded:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        rich = decode(error)
        assert rich.reason == "REPLICA_OVERLOADED"
        assert rich.metadata["dependency"] == "redis"
        assert rich.retry_after_s is not None
        assert rich.retry_after_s > 0
    # What was decided was decided by the script, never by a fail mode.
    assert all(
        v.verdict in (admission_pb2.VERDICT_PASS, admission_pb2.VERDICT_SKIPPED)
        for a in decided
        for v in a.verdicts
    )
    breaker = REGISTRY.get_sample_value(
        "turnstile_dependency_breaker_state", {"dependency": "redis"}
    )
    assert breaker == 0
    admitted = {"sb-warm"} | {
        f"sb-{n}"
        for n, a in enumerate(answers)
        if not isinstance(a, grpc.aio.AioRpcError) and a.decision == ADMITTED
    }
    # A call that ended without a decision may have had its script run: its hold
    # is cancelled in the background, so the pending set ends up holding exactly
    # the admitted sandboxes (nothing waits for a hold's expiry).
    pending = running.keys.pending("acme")
    async with asyncio.timeout(10):
        while await pending_ids(redis, pending) != admitted:  # noqa: ASYNC110 - a state in Redis, no event
            await asyncio.sleep(0.05)


async def pending_ids(redis: aioredis.Redis, key: str) -> set[str]:
    return {m.decode() for m in await redis.zrange(key, 0, -1) if isinstance(m, bytes)}
