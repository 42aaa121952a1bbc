"""Spans carry session, sandbox and tier; metrics count outcomes, resets and leases."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest
from prometheus_client import REGISTRY

from turnstile_testing.otlp import OtlpReceiver, ReceivedSpan

if TYPE_CHECKING:
    from conftest import StartAffinity, StartWorker

PLACE = "/turnstile.affinity.v1.AffinityService/Place"


def _sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, labels) or 0.0


async def test_place_spans_carry_session_sandbox_and_tier(
    affinity: StartAffinity,
    worker: StartWorker,
    otlp_receiver: OtlpReceiver,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", otlp_receiver.endpoint)
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "otlp")
    service = await affinity(tiers="a", grace_s=30)
    a1 = await worker(service.address, "a1", "a", capacity=2)
    await service.release(await service.place("chat", "a"))
    await service.release(await service.place("chat", "a"))  # a hit
    await a1.stop()
    await service.refused("chat", "a")
    await asyncio.to_thread(service.app.tracer_provider.force_flush)  # exports to this loop

    def places(spans: list[ReceivedSpan]) -> list[ReceivedSpan]:
        return [s for s in spans if s.name == PLACE and s.service == "turnstile-affinity"]

    spans = places(await otlp_receiver.wait_for(lambda spans: len(places(spans)) >= 3))
    first, hit, pending = spans[0], spans[1], spans[2]
    assert first.attributes["turnstile.session_id"] == "chat"
    assert first.attributes["turnstile.sandbox_id"] == "a1"
    assert first.attributes["turnstile.tier"] == "a"
    assert first.attributes["turnstile.placement"] == "first"
    assert {k: v for k, v in hit.attributes.items() if k.startswith("turnstile.")} == {
        "turnstile.session_id": "chat",
        "turnstile.sandbox_id": "a1",
        "turnstile.tier": "a",
        "turnstile.placement": "hit",
        "turnstile.client_id": "acme",
    }
    assert pending.attributes["turnstile.sandbox_id"] == "a1"
    assert pending.attributes["turnstile.tier"] == "a"


async def test_metrics_count_outcomes_resets_and_leases(
    affinity: StartAffinity, worker: StartWorker
) -> None:
    before = {
        outcome: _sample("turnstile_affinity_placements_total", tier="m", outcome=outcome)
        for outcome in ("first", "hit", "busy", "exhausted")
    }
    acquired = _sample("turnstile_affinity_leases_total", event="acquired")
    released = _sample("turnstile_affinity_leases_total", event="released")
    service = await affinity(tiers="m")
    await worker(service.address, "m1", "m", capacity=1)
    placed = await service.place("chat", "m")
    await service.refused("chat", "m")
    await service.refused("other", "m")
    await service.release(placed)
    await service.place("chat", "m")
    after = {
        outcome: _sample("turnstile_affinity_placements_total", tier="m", outcome=outcome)
        for outcome in before
    }
    assert {k: after[k] - before[k] for k in before} == {
        "first": 1,
        "hit": 1,
        "busy": 1,
        "exhausted": 1,
    }
    assert _sample("turnstile_affinity_leases_total", event="acquired") - acquired == 2
    assert _sample("turnstile_affinity_leases_total", event="released") - released == 1
