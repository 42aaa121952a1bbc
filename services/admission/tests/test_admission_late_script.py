"""An Admit's script that reaches Redis after its caller gave up on it (SPEC P2, F3).

A reply lost, a send retried, a Cluster redirection followed after the budget
was spent: the decision script can run after admission answered by the fail
modes and after the hold was cancelled — by admission itself (a refusal, a
caller gone) or by the caller it was handed to. The cancel leaves a tombstone
for the hold id, and the late script takes nothing. Here the proxy holds the
script back on its way to Redis until the cancel has run, then sends it on.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from turnstile_contracts import admission_pb2, common_pb2
from turnstile_testing.proxies import ReplyHoldingProxy

ACME = common_pb2.ActivationClient(client_id="acme")
LATE = "sb-late"


@pytest.fixture
async def running(redis: aioredis.Redis, start_proxied: Any) -> Any:
    """Admission through the proxy (node slots fail closed, the rest open), its
    scripts already loaded: the held command is the decision itself, not a
    first EVALSHA that Redis would answer NOSCRIPT."""
    running = await start_proxied(slots={"fail": "closed"})
    await redis.set(running.keys.test_clock, 1_000_000)  # no refill: tokens compare exactly
    warm = await running.stub.Admit(_request("sb-warm", cold=True), timeout=10)
    await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=warm.hold_id))
    return running


def _request(sandbox_id: str, *, cold: bool) -> admission_pb2.AdmitRequest:
    if cold:
        return admission_pb2.AdmitRequest(
            sandbox_id=sandbox_id,
            client=ACME,
            kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
            candidate_nodes=["n1"],
        )
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id, client=ACME, kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM
    )


def _orphan_cancels(result: str) -> float:
    """Admission's background cancels so far, of this result (``absent``: the hold was
    never taken, so a tombstone was left)."""
    value = REGISTRY.get_sample_value(
        "turnstile_admission_orphan_cancels_total", {"result": result}
    )
    return value or 0.0


async def _one_more_orphan_cancel(before: float) -> None:
    """Wait until admission's background cancel has run and found no hold (a
    tombstone left). Its task may have ended before anything here looks, so this
    watches what it counts, not the task."""
    async with asyncio.timeout(10):
        while _orphan_cancels("absent") == before:  # noqa: ASYNC110 - no event to await
            await asyncio.sleep(0.01)
    assert _orphan_cancels("absent") == before + 1


async def _late_script_took_nothing(
    proxy: ReplyHoldingProxy, redis: aioredis.Redis, running: Any
) -> None:
    proxy.deliver()
    reply = await asyncio.wait_for(proxy.late_reply(), 10)
    assert b"cancelled" in reply  # the script ran, and refused to take the hold
    assert b"admit" not in reply
    assert await redis.zcard(running.keys.pending("acme")) == 0
    assert await redis.zcard(running.keys.inflight("acme")) == 0
    assert not [k async for k in redis.scan_iter(match=running.keys.hold("*"))]
    shown = await running.stub.GetUsage(admission_pb2.GetUsageRequest(client=ACME), timeout=10)
    assert shown.pending == 0
    assert shown.in_flight == 0
    assert shown.client_tokens == pytest.approx(shown.client_capacity)
    assert shown.cluster_tokens == pytest.approx(shown.cluster_capacity)
    assert not any(dict(shown.node_slots_held).values())


async def test_a_refused_admits_script_arriving_after_the_orphan_cancel_takes_nothing(
    proxy: ReplyHoldingProxy, redis: aioredis.Redis, running: Any
) -> None:
    absent_before = _orphan_cancels("absent")
    proxy.delay_command(LATE.encode())
    answer = await running.stub.Admit(_request(LATE, cold=True), timeout=10)
    assert proxy.delayed.is_set()  # the script has not reached Redis
    assert answer.decision == admission_pb2.DECISION_REFUSED  # node slots fail closed
    assert answer.refused_by == admission_pb2.POLICY_NODE_SLOTS
    await _one_more_orphan_cancel(absent_before)  # ran, found no hold: a tombstone is left

    await _late_script_took_nothing(proxy, redis, running)


async def test_an_admitted_admits_script_arriving_after_its_callers_cancel_takes_nothing(
    proxy: ReplyHoldingProxy, redis: aioredis.Redis, running: Any
) -> None:
    proxy.delay_command(LATE.encode())
    answer = await running.stub.Admit(_request(LATE, cold=False), timeout=10)
    assert proxy.delayed.is_set()
    assert answer.decision == admission_pb2.DECISION_ADMITTED  # every policy fails open
    cancelled = await running.stub.CancelHold(
        admission_pb2.CancelHoldRequest(hold_id=answer.hold_id), timeout=10
    )
    assert not cancelled.cancelled  # nothing to cancel yet: the script is on its way

    await _late_script_took_nothing(proxy, redis, running)


async def test_an_admit_whose_caller_gave_up_has_its_hold_cancelled(
    proxy: ReplyHoldingProxy, redis: aioredis.Redis, running: Any
) -> None:
    """The caller goes away while the script is on its way, before the budget: it
    never learns the hold id, so admission cancels the hold itself. (Cancelled once
    the script reached the proxy, not by a short deadline: on a loaded machine a
    100 ms deadline could pass before the handler had sent anything.)"""
    absent_before = _orphan_cancels("absent")
    proxy.delay_command(LATE.encode())
    call = running.stub.Admit(_request(LATE, cold=False), timeout=10)
    await asyncio.wait_for(proxy.delayed.wait(), 10)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    await _one_more_orphan_cancel(absent_before)  # on the server's own turn

    await _late_script_took_nothing(proxy, redis, running)
