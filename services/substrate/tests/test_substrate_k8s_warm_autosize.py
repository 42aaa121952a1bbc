"""Demand-sized warm pools (SPEC W1) against the API-server emulator with a kubelet that takes
a while to start pods: the leader measures demand and ready time and sizes the pool."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import pytest
from prometheus_client import REGISTRY

from turnstile_substrate.kubernetes import KubernetesSubstrate
from turnstile_substrate.runtime import LABEL_POOL, LABEL_SANDBOX_ID, LABEL_TIER, RuntimeSpec
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kube_emulator.kubelet import KubeletConfig

if TYPE_CHECKING:
    from conftest import StartSubstrate

NS = "sandboxes"
TIER = "burst"
START_DELAY_S = 0.3


@pytest.fixture
async def slow_kube() -> AsyncIterator[KubeEmulator]:
    async with KubeEmulator(
        bookmark_interval=0.05, kubelet=KubeletConfig(start_delay=START_DELAY_S)
    ) as emulator:
        yield emulator


def warm_count(kube: KubeEmulator) -> int:
    return sum(
        1
        for p in kube.pods(NS)
        if (labels := p["metadata"].get("labels") or {}).get(LABEL_POOL)
        and labels.get(LABEL_TIER) == TIER
        and LABEL_SANDBOX_ID not in labels
    )


def sample(name: str, **labels: str) -> float:
    return REGISTRY.get_sample_value(name, {"tier": TIER, **labels}) or 0.0


async def no_gate() -> None:
    return None


async def activate(sub: KubernetesSubstrate, sandbox: str) -> None:
    spec = RuntimeSpec(sandbox_id=sandbox, tier=TIER, client_label="acme")
    await sub.ensure_runtime(spec, sub.plan(spec), no_gate)


async def test_a_burst_of_activations_grows_an_autosized_pool_beyond_its_minimum(
    slow_kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    tiers = {TIER: {"warm_autosize": True, "warm_min": 1, "warm_max": 8}}
    hits0 = sample("turnstile_substrate_warm_demand_total", result="hit")
    misses0 = sample("turnstile_substrate_warm_demand_total", result="miss")
    async with substrate(slow_kube, tier_runtimes=tiers, warm_require_running=True) as sub:
        await sub.reflector.wait_until(lambda: warm_count(slow_kube) == 1, 5)
        await asyncio.gather(*(activate(sub, f"s{i}") for i in range(10)))
        # every activation is seen as demand (a warm hit or a cold miss)
        await sub.reflector.wait_until(
            lambda: (
                sample("turnstile_substrate_warm_demand_total", result="hit")
                + sample("turnstile_substrate_warm_demand_total", result="miss")
                - hits0
                - misses0
                == 10
            ),
            5,
        )
        assert sample("turnstile_substrate_warm_demand_total", result="miss") > misses0
        await sub.reflector.wait_until(lambda: warm_count(slow_kube) > 1, 5)
        assert warm_count(slow_kube) <= 8
        target = sample("turnstile_substrate_warm_pool", term="target")
        assert 1 < target <= 8
        # the ready time is the kubelet's start delay as the leader measured it
        await sub.reflector.wait_until(
            lambda: sub.pool.sizer(TIER) is not None and sub.pool.sizer(TIER).ready_s < 2.0,  # type: ignore[union-attr]
            5,
        )
        ready = sample("turnstile_substrate_warm_pool", term="ready_seconds")
        assert START_DELAY_S * 0.8 <= ready <= 2.0


async def test_a_static_tier_keeps_its_size_whatever_the_demand(
    slow_kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(
        slow_kube, tier_runtimes={TIER: {"warm_pool_size": 1}}, warm_require_running=False
    ) as sub:
        await sub.reflector.wait_until(lambda: warm_count(slow_kube) == 1, 5)
        await asyncio.gather(*(activate(sub, f"s{i}") for i in range(6)))
        assert sub.pool.sizer(TIER) is None
        assert sub.pool.target_size(TIER) == 1
        await sub.reflector.wait_until(lambda: warm_count(slow_kube) == 1, 5)


def test_autosize_bounds_are_validated() -> None:
    from pydantic import ValidationError

    from turnstile_substrate.kubernetes import KubernetesSettings

    with pytest.raises(ValidationError, match="warm_min must not exceed warm_max"):
        KubernetesSettings.model_validate(
            {"tier_runtimes": {TIER: {"warm_autosize": True, "warm_min": 5, "warm_max": 2}}}
        )
