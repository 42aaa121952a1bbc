"""A fail-open cap never admits past its limit because this replica is overloaded
(issue 10 follow-up; SPEC P1, P6, F3).

The fail mode is for a Redis that is down or hung. When the replica itself
cannot keep up (its event loop starved, more decisions in flight than Redis
connections) a Redis call can spend its budget while Redis answers everyone
else in a millisecond; answering such a call by the fail mode would admit past
the cap. Here the server runs on the test's own event loop beside a task that
burns the CPU every turn, and a few hundred concurrent Admits race for a cap of
7 against real Redis: exactly 7 are admitted, every other answer is a cap
refusal (or, once the overload wait is spent, a retryable REPLICA_OVERLOADED,
never an admission), and the holds of calls that ended without a decision are
cancelled. ``test_admission_bounded.py`` keeps showing that a paused Redis is
still answered by the fail modes within the budget.
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


def overload_waits() -> float:
    value = REGISTRY.get_sample_value(
        "turnstile_dependency_overload_waits_total", {"dependency": "redis"}
    )
    return value or 0.0


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


async def admit_all(stub: Any) -> list[Any]:
    async def one(n: int) -> Any:
        try:
            return await stub.Admit(cold(f"sb-{n}"), timeout=60)
        except grpc.aio.AioRpcError as error:
            return error

    return list(await asyncio.gather(*(one(n) for n in range(CALLS))))


async def test_a_cap_race_on_an_overloaded_replica_admits_exactly_the_cap(
    start_admission: Any,
) -> None:
    running = await start_admission(**SETTINGS)
    waits = overload_waits()
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
    # The race really ran overloaded: calls outlived their Redis budget.
    assert overload_waits() > waits


async def test_an_admit_held_up_past_the_overload_wait_is_refused_retryably_not_admitted(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**SETTINGS, overload_wait_s=BUDGET_S * 2)
    async with starved_event_loop():
        answers = await admit_all(running.stub)
    overloaded = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    decided = [a for a in answers if not isinstance(a, grpc.aio.AioRpcError)]
    admitted = {f"sb-{n}" for n, a in enumerate(answers) if a in decided and a.decision == ADMITTED}
    assert len(admitted) <= CAP
    assert all(a.refused_by == admission_pb2.POLICY_CAP for a in decided if a.decision != ADMITTED)
    assert overloaded, "the loop was not starved enough to spend the overload wait"
    for error in overloaded:
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        rich = decode(error)
        assert rich.reason == "REPLICA_OVERLOADED"
        assert rich.metadata["dependency"] == "redis"
        assert rich.retry_after_s is not None
        assert rich.retry_after_s > 0
    # A call that ended without a decision may have had its script run: its hold
    # is cancelled in the background, so the pending set ends up holding exactly
    # the admitted sandboxes (nothing waits for a hold's expiry).
    pending = running.keys.pending("acme")
    async with asyncio.timeout(10):
        while {m.decode() for m in await redis.zrange(pending, 0, -1)} != admitted:
            await asyncio.sleep(0.05)
