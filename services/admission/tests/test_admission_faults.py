"""Long fault tests (``./scripts/test -m faults``): Redis paused for seconds under
64 Admits in flight, then resumed.

During the pause every decision is answered within the Redis budget by the fail
modes; after it decisions resume by themselves, and once the hold and pending
TTLs have passed nothing is left behind — commands written to the hung Redis run
when it resumes, after their callers gave up, and only the TTLs (SPEC X6) or
admission's own cancel of a refused hold settle those. The figures are printed
(run with -s)."""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform import health_check
from turnstile_testing.processes import RedisProcess

pytestmark = pytest.mark.faults

BUDGET_S = 0.25
MARGIN_S = 0.5
IN_FLIGHT = 64
PAUSE_S = 2.0
TTL_S = 3.0
ACME = common_pb2.ActivationClient(client_id="acme")


def by_fail_mode(answer: Any) -> bool:
    return any(
        v.verdict == admission_pb2.VERDICT_UNKNOWN or "POLICY_BACKEND_UNAVAILABLE" in v.detail
        for v in answer.verdicts
        if v.policy != admission_pb2.POLICY_CAP
    )


@pytest.mark.timeout(120)
async def test_a_paused_redis_under_load_is_answered_by_the_fail_modes_and_leaves_nothing(
    start_admission: Any, private_redis: RedisProcess, fault_settings: Any
) -> None:
    running = await start_admission(redis_url=private_redis.url, **fault_settings(BUDGET_S, TTL_S))
    stub = running.stub
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    calls: list[tuple[float, float, bool, bool]] = []  # start, seconds, normal, fail mode
    counter = 0
    unavailable: list[bool] = []  # per CancelHold that failed: was it UNAVAILABLE?

    async def client(n: int) -> None:
        nonlocal counter
        while not stop.is_set():
            counter += 1
            cold = counter % 2 == 0
            request = admission_pb2.AdmitRequest(
                sandbox_id=f"sb-{n}-{counter}",
                client=ACME,
                kind=common_pb2.ACTIVATION_KIND_COLD_CREATE
                if cold
                else common_pb2.ACTIVATION_KIND_WARM_CLAIM,
                candidate_nodes=["n1"] if cold else [],
            )
            started = loop.time()
            answer = await stub.Admit(request, timeout=10)
            seconds = loop.time() - started
            failed_over = by_fail_mode(answer)
            calls.append((started, seconds, not failed_over, failed_over))
            if answer.hold_id:  # settle it, as the substrate would
                try:
                    await stub.CancelHold(
                        admission_pb2.CancelHoldRequest(hold_id=answer.hold_id), timeout=10
                    )
                except grpc.aio.AioRpcError as error:
                    unavailable.append(error.code() == grpc.StatusCode.UNAVAILABLE)

    clients = [asyncio.create_task(client(n)) for n in range(IN_FLIGHT)]
    await asyncio.sleep(1.0)  # load before the fault
    paused_at = loop.time()
    private_redis.pause()
    await asyncio.sleep(PAUSE_S)
    private_redis.resume()
    resumed_at = loop.time()
    assert await health_check.wait_serving(running.app.address, timeout_s=10, service="redis")
    await asyncio.sleep(1.0)  # load after recovery
    stop.set()
    await asyncio.gather(*clients)

    during = [c for c in calls if paused_at <= c[0] < resumed_at - BUDGET_S]
    normal_times = sorted(c[0] + c[1] for c in calls if c[2])
    gap = max(b - a for a, b in itertools.pairwise(normal_times))
    during_p99 = sorted(c[1] for c in during)[int(len(during) * 0.99) - 1]
    print(
        f"\n{len(calls)} decisions, {sum(c[3] for c in calls)} by a fail mode; "
        f"during the {PAUSE_S:.0f} s pause: {len(during)}, p99 {during_p99 * 1000:.0f} ms; "
        f"longest gap in normal decisions {gap:.2f} s"
    )
    assert during
    assert all(unavailable)  # a cancel that failed did so retryably
    assert all(c[3] for c in during)  # every one answered by the fail modes...
    assert during_p99 < BUDGET_S + MARGIN_S  # ...within the budget
    assert any(c[2] and c[0] > resumed_at for c in calls)  # decisions resumed by themselves

    # Nothing leaks: once the TTLs have passed, every hold, lease, slot and
    # pending entry is gone (polled: expiry is Redis's clock, not an event here).
    started = time.monotonic()
    request = admission_pb2.GetUsageRequest(client=ACME)
    async with asyncio.timeout(TTL_S + 10):
        while True:
            usage = await stub.GetUsage(request, timeout=10)
            if (usage.pending, usage.in_flight, dict(usage.node_slots_held)) == (0, 0, {}):
                break
            await asyncio.sleep(0.1)
    print(f"drained {time.monotonic() - started:.1f} s after the load stopped")
