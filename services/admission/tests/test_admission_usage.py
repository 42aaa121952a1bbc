"""GetUsage, key-set changes, limits reloaded without a restart, node slots over
the hold lifecycle, and spans carrying the decision."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor

from turnstile_clientkeys import KeySetStore
from turnstile_clientkeys.limits import Limits, LimitsError, LimitsStore, limits_key
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_testing.otlp import OtlpReceiver

ADMITTED = admission_pb2.DECISION_ADMITTED


def client(client_id: str) -> common_pb2.ActivationClient:
    return common_pb2.ActivationClient(client_id=client_id)


def cold(sandbox_id: str, client_id: str = "acme", **extra: Any) -> admission_pb2.AdmitRequest:
    return admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=client(client_id),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
        **extra,
    )


async def usage(stub: Any, client_id: str) -> Any:
    return await stub.GetUsage(admission_pb2.GetUsageRequest(client=client(client_id)))


async def test_usage_shows_live_pending_tokens_in_flight_and_slots(
    start_admission: Any, live: Any, redis: aioredis.Redis
) -> None:
    await live.counted("acme", "old-1")
    running = await start_admission(client_allowlist=("acme",), test_clock=True)
    await redis.set(running.keys.test_clock, 1_000_000)  # no refill between the calls
    first = await running.stub.Admit(cold("sb-1", candidate_nodes=["n1"]))
    await running.stub.Admit(cold("sb-2"))
    await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=first.hold_id))
    shown = await usage(running.stub, "acme")
    assert shown.key.key == "acme"
    assert shown.key.key_set_version == 1
    assert shown.live == 1
    assert shown.live_unknown == ""
    assert (shown.pending, shown.cap) == (2, 20)
    assert shown.client_capacity == 20
    assert shown.client_tokens == pytest.approx(18)
    assert shown.cluster_capacity == 200
    assert shown.cluster_tokens == pytest.approx(198)
    assert (shown.in_flight, shown.concurrency_limit) == (1, 10)  # sb-1 committed
    assert dict(shown.node_slots_held) == {"n1": 1}


async def test_usage_says_why_the_live_count_is_unknown(start_admission: Any, live: Any) -> None:
    running = await start_admission(client_allowlist=("acme",))
    await live.unsupported()
    shown = await usage(running.stub, "acme")
    assert not shown.HasField("live")
    assert shown.live_unknown == "unsupported"
    await live.unavailable()
    shown = await usage(running.stub, "acme")
    assert not shown.HasField("live")
    assert shown.live_unknown == "unavailable"


async def test_node_slot_is_the_sandboxs_after_commit_until_release(start_admission: Any) -> None:
    running = await start_admission(client_allowlist=("acme",), slots={"per_node": {"n1": 1}})
    stub = running.stub
    held = await stub.Admit(cold("sb-1", candidate_nodes=["n1"]))
    assert held.node == "n1"
    await stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=held.hold_id))
    refused = await stub.Admit(cold("sb-2", candidate_nodes=["n1"]))
    assert refused.refused_by == admission_pb2.POLICY_NODE_SLOTS
    released = await stub.ReleaseSandbox(admission_pb2.ReleaseSandboxRequest(sandbox_id="sb-1"))
    assert released.released
    again = await stub.ReleaseSandbox(admission_pb2.ReleaseSandboxRequest(sandbox_id="sb-1"))
    assert not again.released
    assert (await stub.Admit(cold("sb-2", candidate_nodes=["n1"]))).node == "n1"


async def test_uncommitted_hold_frees_its_slot_and_lease_when_it_expires(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(
        client_allowlist=("acme",),
        test_clock=True,
        slots={"per_node": {"n1": 1}},
        concurrency={"default_limit": 1},
    )
    await redis.set(running.keys.test_clock, 1_000_000)
    held = await running.stub.Admit(cold("sb-1", candidate_nodes=["n1"]))
    blocked = await running.stub.Admit(cold("sb-2", candidate_nodes=["n1"]))
    assert blocked.decision == admission_pb2.DECISION_REFUSED
    await redis.set(running.keys.test_clock, 1_000_000 + 60_000)  # the hold's TTL
    after = await running.stub.Admit(cold("sb-2", candidate_nodes=["n1"]))
    assert after.decision == ADMITTED
    assert after.node == "n1"
    late = await running.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=held.hold_id))
    assert not late.committed


async def test_key_set_change_moves_a_client_between_its_own_bucket_and_the_shared_one(
    admission: Any, redis: aioredis.Redis, redis_prefix: str
) -> None:
    stub = admission.stub
    before = await stub.Admit(cold("sb-1"))
    assert (before.key.key, before.key.key_set_version) == ("shared", 1)
    store = KeySetStore(redis, redis_prefix)
    await store.change(allow=("acme",))
    answer = before
    async with asyncio.timeout(5):  # propagation: pub/sub, then the poll
        while answer.key.key_set_version < 2:
            answer = await stub.Admit(cold("sb-2"))
    assert (answer.key.key, answer.key.kind) == ("acme", common_pb2.KEY_KIND_OWN)
    own, shared = await usage(stub, "acme"), await usage(stub, "other")
    assert own.client_tokens == pytest.approx(19, abs=0.1)  # charged to its own bucket
    assert shared.key.key == "shared"
    assert shared.client_tokens < 20  # sb-1 was charged to the shared one
    await store.change(remove=("acme",))
    async with asyncio.timeout(5):
        while answer.key.key_set_version < 3:
            answer = await stub.Admit(cold("sb-3"))
    assert answer.key.key == "shared"


async def test_limits_change_applies_on_the_next_decision_without_restart(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(client_allowlist=("acme",))
    assert (await running.stub.Admit(cold("sb-1"))).decision == ADMITTED
    await LimitsStore(redis, running.keys.prefix).set_key("acme", Limits(cap=1))
    refused = await running.stub.Admit(cold("sb-2"))
    assert refused.refused_by == admission_pb2.POLICY_CAP
    assert (refused.limit, refused.current) == (1, 1)
    assert refused.retry_after.ToMilliseconds() == 5000
    assert (await usage(running.stub, "acme")).cap == 1


def test_the_shared_limits_hash_is_the_one_admit_lua_reads() -> None:
    from turnstile_admission.keys import AdmissionKeys

    assert limits_key("p:") == AdmissionKeys("p:").limits


def test_limits_reject_invalid_values() -> None:
    bad: Any
    for bad in ({"cap": -1}, {"rate": 0}, {"burst": 0.5}, {"cap": 1.5}, {"bogus": 1}, []):
        with pytest.raises(LimitsError):
            Limits.parse(bad)
    assert Limits.parse({"cap": 3, "rate": 0.5}) == Limits(cap=3, rate=0.5)


async def test_admit_span_carries_key_version_and_verdicts(
    start_admission: Any, otlp_receiver: OtlpReceiver
) -> None:
    provider = TracerProvider()
    provider.add_span_processor(
        BatchSpanProcessor(
            OTLPSpanExporter(endpoint=otlp_receiver.endpoint, insecure=True),
            schedule_delay_millis=50,
        )
    )
    running = await start_admission(client_allowlist=("acme",), tracer_provider=provider)
    await running.stub.Admit(cold("sb-1"))

    def admit_span(spans: list[Any]) -> bool:
        return any(s.name.endswith("/Admit") for s in spans)

    spans = await otlp_receiver.wait_for(admit_span)
    span = next(s for s in spans if s.name.endswith("/Admit"))
    assert span.attributes["turnstile.key"] == "acme"
    assert span.attributes["turnstile.key_set_version"] == 1
    assert span.attributes["turnstile.admission.decision"] == "admitted"
    assert span.attributes["turnstile.admission.verdict.cap"] == "pass"
    assert span.attributes["turnstile.admission.verdict.node_slots"] == "skipped"
