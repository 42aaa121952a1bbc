"""Modes and fail modes: shadow records and admits, off skips, a fail-open policy
admits while Redis is down and a fail-closed one refuses, and both recover."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from turnstile_clientkeys import KeySetStore
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform import health_check
from turnstile_platform.errors import decode
from turnstile_testing.processes import RedisProcess
from turnstile_testing.redis_topologies import connect

ADMITTED = admission_pb2.DECISION_ADMITTED
REFUSED = admission_pb2.DECISION_REFUSED


def request(
    sandbox_id: str,
    kind: common_pb2.ActivationKind.ValueType = common_pb2.ACTIVATION_KIND_COLD_CREATE,
    **extra: Any,
) -> Any:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id="acme"),
        kind=kind,
        **extra,
    )


def verdict(answer: Any, policy: int) -> Any:
    return next(v for v in answer.verdicts if v.policy == policy)


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_shadow_policy_records_the_refusal_and_admits(start_admission: Any) -> None:
    running = await start_admission(
        client_allowlist=("acme",), concurrency={"mode": "shadow", "default_limit": 1}
    )
    shadowed = sample("turnstile_admission_shadow_refusals_total", policy="concurrency", key="acme")
    first = await running.stub.Admit(request("sb-1"))
    second = await running.stub.Admit(request("sb-2"))
    assert first.decision == second.decision == ADMITTED
    concurrency = verdict(second, admission_pb2.POLICY_CONCURRENCY)
    assert concurrency.verdict == admission_pb2.VERDICT_SHADOW_REFUSE
    assert concurrency.mode == admission_pb2.POLICY_MODE_SHADOW
    assert (concurrency.limit, concurrency.current) == (1, 1)
    assert "shadow refusals: concurrency" in second.message
    after = sample("turnstile_admission_shadow_refusals_total", policy="concurrency", key="acme")
    assert after == shadowed + 1


async def test_off_policy_is_skipped_and_keeps_no_state(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(
        client_allowlist=("acme",), rate={"mode": "off"}, concurrency={"mode": "off"}
    )
    answer = await running.stub.Admit(request("sb-1"))
    assert answer.decision == ADMITTED
    for policy in (admission_pb2.POLICY_RATE, admission_pb2.POLICY_CONCURRENCY):
        skipped = verdict(answer, policy)
        assert skipped.verdict == admission_pb2.VERDICT_SKIPPED
        assert skipped.detail == "off"
    assert not await redis.exists(running.keys.bucket("acme"), running.keys.inflight("acme"))
    assert await redis.exists(running.keys.pending("acme"))


async def test_cap_admits_with_an_unknown_verdict_when_the_substrate_cannot_count(
    start_admission: Any, live: Any
) -> None:
    await live.unsupported()  # the Direct substrate's declaration (SPEC S4)
    running = await start_admission(client_allowlist=("acme",), cap={"default_cap": 2})
    labels = {"policy": "cap", "key": "acme"}
    unsupported = sample("turnstile_admission_fail_open_total", backend="unsupported", **labels)
    outage = sample("turnstile_admission_fail_open_total", backend="redis", **labels)
    answer = await running.stub.Admit(request("sb-1"))
    assert answer.decision == ADMITTED
    cap = verdict(answer, admission_pb2.POLICY_CAP)
    assert cap.verdict == admission_pb2.VERDICT_UNKNOWN
    assert "unsupported" in cap.detail
    # Counted apart from an outage, which TurnstileAdmissionFailingOpen alerts on.
    after = sample("turnstile_admission_fail_open_total", backend="unsupported", **labels)
    assert after == unsupported + 1
    assert sample("turnstile_admission_fail_open_total", backend="redis", **labels) == outage


async def test_cap_refuses_at_the_cap_on_pending_alone_when_the_substrate_cannot_count(
    start_admission: Any, live: Any
) -> None:
    """The Direct substrate's default (no live count) with 2 admitted, still-pending
    sandboxes and a cap of 2: the third is refused, not admitted as UNKNOWN by the
    fail-open default. Pending alone is a lower bound of the live count (SPEC P1)."""
    await live.unsupported()
    running = await start_admission(client_allowlist=("acme",), cap={"default_cap": 2})
    first = [await running.stub.Admit(request(f"sb-{n}")) for n in (1, 2)]
    assert [a.decision for a in first] == [ADMITTED, ADMITTED]
    for answer in first:
        await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=answer.hold_id))

    third = await running.stub.Admit(request("sb-3"))

    assert third.decision == admission_pb2.DECISION_REFUSED
    assert (third.refused_by, third.limit, third.current) == (admission_pb2.POLICY_CAP, 2, 2)
    cap = verdict(third, admission_pb2.POLICY_CAP)
    assert cap.verdict == admission_pb2.VERDICT_REFUSE
    assert "pending alone" in cap.detail
    # A cap frees when a sandbox stops: the refusal says so, not only a time.
    assert third.message.endswith("; frees when one of its 2 live or pending sandboxes stops")
    # An activation already pending is not counted against itself.
    assert (await running.stub.Admit(request("sb-2"))).decision == ADMITTED


async def test_an_unavailable_live_count_is_a_lower_bound_the_pending_set_alone_refuses(
    start_admission: Any, live: Any
) -> None:
    """No current count (no leader, or a leader behind) is not a licence (SPEC S4):
    zero live, every pending entry counted; only an unsupported count admits unknown."""
    await live.counted("acme", "live-1", "live-2", "live-3")
    await live.unavailable()  # the live set is there, but nobody vouches for it
    running = await start_admission(client_allowlist=("acme",), cap={"default_cap": 2})
    first = [await running.stub.Admit(request(f"sb-{n}")) for n in (1, 2)]
    assert [a.decision for a in first] == [ADMITTED, ADMITTED]
    assert verdict(first[1], admission_pb2.POLICY_CAP).verdict == admission_pb2.VERDICT_PASS

    third = await running.stub.Admit(request("sb-3"))

    assert third.decision == admission_pb2.DECISION_REFUSED
    assert (third.refused_by, third.limit, third.current) == (admission_pb2.POLICY_CAP, 2, 2)
    cap = verdict(third, admission_pb2.POLICY_CAP)
    assert cap.verdict == admission_pb2.VERDICT_REFUSE
    assert "pending alone" in cap.detail
    # The sandbox's own pending entry is not counted against it: a retry of sb-2 passes.
    assert (await running.stub.Admit(request("sb-2"))).decision == ADMITTED


async def test_fail_open_admits_and_fail_closed_refuses_while_redis_is_down_then_both_recover(
    start_admission: Any, private_redis: RedisProcess
) -> None:
    running = await start_admission(
        redis_url=private_redis.url,
        client_allowlist=("acme",),
        slots={"fail": "closed"},
        rate={"fail": "open"},
    )
    slotted = request("sb-1", candidate_nodes=["n1"])
    assert (await running.stub.Admit(slotted)).decision == ADMITTED
    fail_open = sample(
        "turnstile_admission_fail_open_total", policy="rate", backend="redis", key="acme"
    )

    unlogged = {
        d: sample("turnstile_admission_decisions_unlogged_total", decision=d)
        for d in ("fail_open", "fail_closed")
    }

    private_redis.stop()
    # A warm claim skips node slots: every evaluated policy fails open.
    warm = await running.stub.Admit(request("sb-2", kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM))
    assert warm.decision == ADMITTED
    assert warm.hold_id
    for policy in (
        admission_pb2.POLICY_CAP,
        admission_pb2.POLICY_RATE,
        admission_pb2.POLICY_CONCURRENCY,
    ):
        assert verdict(warm, policy).verdict == admission_pb2.VERDICT_UNKNOWN
        assert "failing open" in verdict(warm, policy).detail
    assert (
        sample("turnstile_admission_fail_open_total", policy="rate", backend="redis", key="acme")
        == fail_open + 1
    )
    # A cold create on nodes: node slots fail closed.
    cold = await running.stub.Admit(request("sb-3", candidate_nodes=["n1"]))
    assert cold.decision == REFUSED
    assert cold.refused_by == admission_pb2.POLICY_NODE_SLOTS
    slots = verdict(cold, admission_pb2.POLICY_NODE_SLOTS)
    assert slots.verdict == admission_pb2.VERDICT_REFUSE
    assert slots.detail.startswith("POLICY_BACKEND_UNAVAILABLE")
    assert cold.retry_after.ToMilliseconds() > 0
    # The decision log is in the Redis that is down: both decisions are counted
    # (and logged as lines) instead (SPEC Q3).
    assert {
        d: sample("turnstile_admission_decisions_unlogged_total", decision=d) - before
        for d, before in unlogged.items()
    } == {"fail_open": 1, "fail_closed": 1}
    # Holds cannot be settled without Redis: UNAVAILABLE, retryable.
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=warm.hold_id))
    assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
    assert decode(raised.value).retryable

    private_redis.start()
    # Health turns SERVING once a PING succeeds (the breaker's probe); from then
    # on the very first decision is a normal one, asserted without a retry.
    assert await health_check.wait_serving(running.app.address, timeout_s=10, service="redis")
    recovered = await running.stub.Admit(request("sb-4", candidate_nodes=["n1"]))
    assert recovered.decision == ADMITTED
    assert all(
        v.verdict == admission_pb2.VERDICT_PASS
        for v in recovered.verdicts
        if v.policy != admission_pb2.POLICY_CAP
    )
    assert verdict(recovered, admission_pb2.POLICY_NODE_SLOTS).current == 0  # fresh Redis
    # The fail-open admit recorded nothing, so settling it is a harmless no-op.
    gone = await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=warm.hold_id))
    assert not gone.committed


async def test_a_rate_refusal_says_to_retry_when_the_bucket_will_hold_a_token(
    start_admission: Any,
) -> None:
    # 0.25 tokens/s: an empty bucket holds a whole token again only after 4 s,
    # longer than the policy's 1 s default hint.
    running = await start_admission(
        client_allowlist=("acme",),
        rate={"default_burst": 1, "default_rate_per_s": 0.25},
        concurrency={"mode": "off"},
    )
    assert (await running.stub.Admit(request("sb-1"))).decision == ADMITTED
    refused = await running.stub.Admit(request("sb-2"))
    assert refused.refused_by == admission_pb2.POLICY_RATE
    assert 3.0 < refused.retry_after.ToMilliseconds() / 1000 <= 4.0


async def test_a_concurrency_refusal_hint_is_capped_by_its_setting_not_the_lease_expiry(
    start_admission: Any,
) -> None:
    # The lease expires with its hold (a minute here); commit or cancel usually
    # frees it long before, so the hint is the setting's 1 s (docs/admission.md).
    running = await start_admission(
        client_allowlist=("acme",), concurrency={"default_limit": 1, "retry_after_s": 1.0}
    )
    assert (await running.stub.Admit(request("sb-1"))).decision == ADMITTED
    refused = await running.stub.Admit(request("sb-2"))
    assert refused.refused_by == admission_pb2.POLICY_CONCURRENCY
    assert 0 < refused.retry_after.ToMilliseconds() <= 1000


async def test_a_key_that_leaves_the_key_set_leaves_the_per_key_gauges(
    start_admission: Any, redis_url: str
) -> None:
    running = await start_admission(client_allowlist=("gauged",))
    gauged = admission_pb2.AdmitRequest(
        sandbox_id="sb-g",
        client=common_pb2.ActivationClient(client_id="gauged"),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
    )
    assert (await running.stub.Admit(gauged)).decision == ADMITTED
    pending = "turnstile_admission_pending_entries"
    assert REGISTRY.get_sample_value(pending, {"key": "gauged"}) is not None

    client = connect(redis_url)
    try:
        await KeySetStore(client, running.settings.redis_prefix).change(remove=("gauged",))
    finally:
        await client.aclose()

    # The change arrives by pub/sub or the version poll (no event to await here).
    for _ in range(600):
        if REGISTRY.get_sample_value(pending, {"key": "gauged"}) is None:
            break
        await asyncio.sleep(0.05)
    assert REGISTRY.get_sample_value(pending, {"key": "gauged"}) is None


async def test_pending_entries_that_expire_unconsumed_are_counted_once_by_bounded_key(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    """``turnstile_admission_pending_expired_total{key}`` counts what the scripts
    report dropping: by the Admit or GetUsage that drops them, once."""
    running = await start_admission(client_allowlist=("acme",), test_clock=True)
    await redis.set(running.keys.test_clock, 1_000_000)
    before = sample("turnstile_admission_pending_expired_total", key="acme")
    assert (await running.stub.Admit(request("sb-1"))).decision == ADMITTED
    assert (await running.stub.Admit(request("sb-2"))).decision == ADMITTED

    await redis.set(running.keys.test_clock, 1_000_000 + 121_000)  # past the 120 s TTL
    usage = await running.stub.GetUsage(
        admission_pb2.GetUsageRequest(client=common_pb2.ActivationClient(client_id="acme"))
    )
    assert usage.pending == 0
    assert (await running.stub.Admit(request("sb-3"))).decision == ADMITTED

    assert sample("turnstile_admission_pending_expired_total", key="acme") == before + 2


async def test_each_decision_counts_its_own_outcome_and_verdicts(start_admission: Any) -> None:
    """The decision metrics are looked up once per decision shape: an admitted and a
    refused decision of one key each move their own series, every time."""
    running = await start_admission(client_allowlist=("acme",), cap={"default_cap": 1})
    name = "turnstile_admission_decisions_total"
    verdicts = "turnstile_admission_policy_verdicts_total"
    admitted = sample(name, decision="admitted", refused_by="", key="acme")
    refused = sample(name, decision="refused", refused_by="cap", key="acme")
    cap_pass = sample(verdicts, policy="cap", verdict="pass", key="acme")
    cap_refuse = sample(verdicts, policy="cap", verdict="refuse", key="acme")
    answers = [await running.stub.Admit(request(f"sb-{i}")) for i in range(3)]
    assert [a.decision for a in answers] == [ADMITTED, REFUSED, REFUSED]
    assert sample(name, decision="admitted", refused_by="", key="acme") == admitted + 1
    assert sample(name, decision="refused", refused_by="cap", key="acme") == refused + 2
    assert sample(verdicts, policy="cap", verdict="pass", key="acme") == cap_pass + 1
    assert sample(verdicts, policy="cap", verdict="refuse", key="acme") == cap_refuse + 2
