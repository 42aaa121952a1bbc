"""A fail-open cap never admits past its limit because this replica is overloaded
(SPEC P1, P6, F3).

The fail mode is for a Redis that is down or hung. When the replica itself
cannot keep up (its event loop starved, more decisions in flight than Redis
connections) a Redis call can spend its budget while Redis answers everyone
else in a millisecond; answering such a call by the fail mode would admit past
the cap. Here the server runs on the test's own event loop beside a task that
burns the CPU every turn, and a few hundred concurrent Admits race for a cap of
7 against real Redis: exactly 7 are admitted, every other answer is a cap
refusal. ``test_admission_bounded.py`` keeps showing that a paused Redis is
still answered by the fail modes within the budget; ``libs/platform``'s
``test_bounded.py`` that a call held up past the overload wait fails as
overloaded. The second test pushes a burst far past what the starved replica
can decide within a short overload wait: the calls it cannot get done are shed
(UNAVAILABLE / REPLICA_OVERLOADED, counted), never answered by the fail mode.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
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


def sheds() -> float:
    """Admits this process's servers shed because Redis calls were held up here."""
    value = REGISTRY.get_sample_value(
        "turnstile_grpc_server_dependency_refusals_total",
        {
            "grpc_service": "turnstile.admission.v1.AdmissionService",
            "grpc_method": "Admit",
            "dependency": "redis",
            "reason": "REPLICA_OVERLOADED",
        },
    )
    return value or 0.0


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
async def starved_event_loop(stall_s: float = STALL_S) -> AsyncIterator[None]:
    """A task on this (the server's) event loop that burns the CPU in every turn
    of it, as a saturated replica's loop is: ``BURN_S`` each turn, and a stall
    (``stall_s``, longer than the Redis budget) every ``STALL_EVERY`` turns (a
    big batch of work, a garbage collection)."""
    stop = asyncio.Event()

    async def burn() -> None:
        turn = 0
        while not stop.is_set():
            turn += 1
            until = time.perf_counter() + (stall_s if turn % STALL_EVERY == 0 else BURN_S)
            while time.perf_counter() < until:
                pass
            await asyncio.sleep(0)

    task = asyncio.create_task(burn())
    try:
        yield
    finally:
        stop.set()
        await task


async def admit_all(stub: Any, calls: int = CALLS, deadline_s: float = 60) -> list[Any]:
    async def one(n: int) -> Any:
        try:
            return await stub.Admit(cold(f"sb-{n}"), timeout=deadline_s)
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


#: A burst far past what the starved replica decides within the overload wait.
BURST = 400
#: As short as it goes (one budget), so the calls queued longest for the Redis
#: connection outlive it.
OVERLOAD_WAIT_S = BUDGET_S
#: Far fewer Redis connections than decisions in flight.
CONNECTIONS = 1
RETRY_AFTER_S = 3.0
DEADLINE_S = 30.0


@pytest.mark.timeout(120)
async def test_a_burst_past_a_starved_replicas_capacity_is_shed_never_failed_open(
    start_admission: Any,
) -> None:
    """A starved replica with one Redis connection for hundreds of decisions in
    flight: decisions queue for a connection while Redis answers the others.
    Every policy fails open here, so an overload answered as an outage would
    admit: admissions stay within the cap (+1, the brief's allowance for one call
    whose Redis really was unreachable), and what the replica could not decide
    in time is refused retryably with the service's hint, each one counted."""
    settings = {
        **SETTINGS,
        "overload_wait_s": OVERLOAD_WAIT_S,
        "redis_max_connections": CONNECTIONS,
        "retry_after_s": RETRY_AFTER_S,
        "rate": {"default_burst": 10_000, "cluster_burst": 10_000, "fail": "open"},
        "concurrency": {"default_limit": 10_000, "fail": "open"},
        "cap": {"default_cap": CAP, "fail": "open"},
    }
    running = await start_admission(**settings)
    shed_before = sheds()
    async with starved_event_loop():
        started = time.perf_counter()
        answers = await admit_all(running.stub, BURST, DEADLINE_S)
        seconds = time.perf_counter() - started
    errors = [a for a in answers if isinstance(a, grpc.aio.AioRpcError)]
    # A call still waiting at its deadline ended there (the caller's own choice).
    late = [a for a in errors if a.code() == grpc.StatusCode.DEADLINE_EXCEEDED]
    failed = [a for a in errors if a not in late]
    decided = [a for a in answers if not isinstance(a, grpc.aio.AioRpcError)]
    admitted = [a for a in decided if a.decision == ADMITTED]
    assert len(admitted) <= CAP + 1, len(admitted)
    unknown = admission_pb2.VERDICT_UNKNOWN
    assert not [v for a in admitted for v in a.verdicts if v.verdict == unknown]
    assert all(a.refused_by == admission_pb2.POLICY_CAP for a in decided if a not in admitted)
    for error in failed:
        rich = decode(error)
        assert rich.code == grpc.StatusCode.UNAVAILABLE, rich
        assert rich.reason == "REPLICA_OVERLOADED", rich
        assert rich.metadata == {"dependency": "redis"}
        assert rich.retry_after_s == RETRY_AFTER_S
    # Each shed is counted; one answered as its caller's deadline passed reaches
    # the caller as DEADLINE_EXCEEDED instead.
    assert len(failed) <= sheds() - shed_before <= len(failed) + len(late)
    # The burst really outran the replica: some calls were shed.
    summary = f"{len(admitted)} admitted, {len(decided)} decided, {len(failed)} shed, "
    summary += f"{len(late)} past their deadline, in {seconds:.1f}s"
    assert failed, summary
    print(summary)
