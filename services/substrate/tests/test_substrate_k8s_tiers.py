"""Tiers that are different runtimes (SPEC S1, T6), on the API-server emulator with the
sandbox namespace's ``restricted`` Pod Security level enforced: the pods each tier produces,
warm and cold, carry that tier's RuntimeClass, nodes and resources; a claim takes only a warm
pod of its own tier; and the real ``kubectl`` reads the same runtimes back."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from turnstile_substrate.kubernetes import KubernetesSubstrate
from turnstile_substrate.runtime import (
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TIER,
    CreateKind,
    Plan,
    RuntimeSpec,
)
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kubectl import KUBECTL, run_kubectl

if TYPE_CHECKING:
    from conftest import StartSubstrate

NS = "sandboxes"

#: The two tiers the manifests declare: plain containers with a warm pool, and Kata microVMs
#: on nodes set aside for them (tainted), with a smaller warm pool.
MICROVM_NODES = {"turnstile.dev/runtime": "kata"}
MICROVM_TOLERATION = {"key": "turnstile.dev/microvm", "operator": "Exists", "effect": "NoSchedule"}
TIERS: dict[str, Any] = {
    "container": {"warm_pool_size": 1},
    "microvm": {
        "runtime_class_name": "kata",
        "memory_limit": "2Gi",
        "node_selector": MICROVM_NODES,
        "tolerations": [MICROVM_TOLERATION],
        "warm_pool_size": 1,
    },
}


def spec(sandbox: str, tier: str) -> RuntimeSpec:
    return RuntimeSpec(sandbox_id=sandbox, tier=tier, client_label="acme")


async def no_gate() -> None:
    return None


def warm_in(kube: KubeEmulator, tier: str) -> list[str]:
    return sorted(
        p["metadata"]["name"]
        for p in kube.pods(NS)
        if (labels := p["metadata"].get("labels") or {}).get(LABEL_TIER) == tier
        and LABEL_POOL in labels
        and LABEL_SANDBOX_ID not in labels
    )


async def pools_full(sub: KubernetesSubstrate, kube: KubeEmulator, *tiers: str) -> None:
    """Wait until each tier has its warm pod on the server and in the cache."""
    await sub.reflector.wait_until(
        lambda: all(
            len(warm_in(kube, tier)) == 1
            and [p.name for p in sub.index.warm(tier)] == warm_in(kube, tier)
            for tier in tiers
        ),
        5,
    )


def runtime_of(kube: KubeEmulator, name: str) -> dict[str, Any]:
    """The runtime-choosing fields of a stored pod's spec."""
    pod = kube.pod(NS, name)
    assert pod is not None
    spec = pod["spec"]
    return {
        "runtimeClassName": spec.get("runtimeClassName"),
        "nodeSelector": spec.get("nodeSelector"),
        "tolerations": spec.get("tolerations"),
        "memory_limit": spec["containers"][0]["resources"]["limits"].get("memory"),
    }


MICROVM_RUNTIME = {
    "runtimeClassName": "kata",
    "nodeSelector": MICROVM_NODES,
    "tolerations": [MICROVM_TOLERATION],
    "memory_limit": "2Gi",
}
CONTAINER_RUNTIME = {
    "runtimeClassName": None,
    "nodeSelector": None,
    "tolerations": None,
    "memory_limit": "1Gi",
}


async def test_warm_and_cold_pods_of_each_tier_run_on_that_tiers_runtime(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube, tier_runtimes=TIERS) as sub:
        await pools_full(sub, kube, "container", "microvm")
        [warm_micro], [warm_plain] = warm_in(kube, "microvm"), warm_in(kube, "container")
        # a cold create per tier too (the plan says cold: no warm claim)
        cold_micro = await sub.ensure_runtime(
            spec("m-cold", "microvm"), Plan(CreateKind.COLD), no_gate
        )
        cold_plain = await sub.ensure_runtime(
            spec("c-cold", "container"), Plan(CreateKind.COLD), no_gate
        )

    # every pod was admitted by the restricted Pod Security level (the fixture enforces it)
    assert runtime_of(kube, warm_micro) == MICROVM_RUNTIME
    assert runtime_of(kube, cold_micro.name) == MICROVM_RUNTIME
    assert runtime_of(kube, warm_plain) == CONTAINER_RUNTIME
    assert runtime_of(kube, cold_plain.name) == CONTAINER_RUNTIME


async def test_a_claim_takes_only_a_warm_pod_of_its_own_tier(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    tiers = {**TIERS, "container": {"warm_pool_size": 0}}  # only microvm keeps warm pods
    async with substrate(kube, tier_runtimes=tiers) as sub:
        await pools_full(sub, kube, "microvm")
        [warm_micro] = warm_in(kube, "microvm")

        plain = spec("c1", "container")
        assert sub.plan(plain).kind is CreateKind.COLD
        # even asked for a warm claim, a container activation never takes the microVM pod
        runtime = await sub.ensure_runtime(plain, Plan(CreateKind.WARM), no_gate)
        assert runtime.kind is CreateKind.COLD
        assert runtime.name != warm_micro
        assert warm_in(kube, "microvm") == [warm_micro]
        assert runtime_of(kube, runtime.name) == CONTAINER_RUNTIME

        micro = spec("m1", "microvm")
        assert sub.plan(micro).kind is CreateKind.WARM
        claimed = await sub.ensure_runtime(micro, sub.plan(micro), no_gate)
        assert (claimed.kind, claimed.name, claimed.tier) == (
            CreateKind.WARM,
            warm_micro,
            "microvm",
        )
        assert runtime_of(kube, claimed.name) == MICROVM_RUNTIME


@pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed")
async def test_kubectl_reads_each_tiers_runtime_back_from_the_pods_it_produced(
    kube: KubeEmulator, substrate: StartSubstrate, tmp_path: Path
) -> None:
    async with substrate(kube, tier_runtimes=TIERS) as sub:
        await pools_full(sub, kube, "container", "microvm")
        await sub.ensure_runtime(spec("m-cold", "microvm"), Plan(CreateKind.COLD), no_gate)
        await sub.ensure_runtime(spec("c-cold", "container"), Plan(CreateKind.COLD), no_gate)

    for tier, runtime_class in (("microvm", "kata"), ("container", None)):
        code, out, err = await run_kubectl(
            kube.url, tmp_path, NS, "get", "pods", "-l", f"{LABEL_TIER}={tier}", "-o", "json"
        )
        assert code == 0, err
        pods = json.loads(out)["items"]
        assert len(pods) == 2, f"{tier}: one warm and one cold pod"
        expected_nodes = MICROVM_NODES if runtime_class else None
        for pod in pods:
            assert pod["spec"].get("runtimeClassName") == runtime_class, pod["metadata"]["name"]
            assert pod["spec"].get("nodeSelector") == expected_nodes
        assert pods == [kube.pod(NS, p["metadata"]["name"]) for p in pods]
    code, out, err = await run_kubectl(
        kube.url,
        tmp_path,
        NS,
        "get",
        "pods",
        "-l",
        f"{LABEL_TIER}=microvm",
        "-o",
        "jsonpath={range .items[*]}{.spec.runtimeClassName}{'\\n'}{end}",
    )
    assert code == 0, err
    assert out.split() == ["kata", "kata"]


async def test_warm_pods_of_an_older_template_are_never_claimed_and_are_replaced(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    # the microvm tier's warm pod was made while the tier still ran plain containers
    before = {"microvm": {"warm_pool_size": 1}}
    async with substrate(kube, tier_runtimes=before) as sub:
        await pools_full(sub, kube, "microvm")
        [stale] = warm_in(kube, "microvm")
        await sub.pool.stop()
    assert runtime_of(kube, stale)["runtimeClassName"] is None

    async with substrate(kube, tier_runtimes=TIERS) as sub:
        micro = spec("m1", "microvm")
        # not claimable, whatever the plan: a cold create on the tier's runtime instead
        runtime = await sub.ensure_runtime(micro, Plan(CreateKind.WARM), no_gate)
        assert runtime.kind is CreateKind.COLD
        assert runtime_of(kube, runtime.name) == MICROVM_RUNTIME
        # and the refill replaces it with a pod of the current template
        await sub.reflector.wait_until(
            lambda: kube.pod(NS, stale) is None and len(warm_in(kube, "microvm")) == 1, 5
        )
        [fresh] = warm_in(kube, "microvm")
        assert runtime_of(kube, fresh) == MICROVM_RUNTIME
        claimed = await sub.ensure_runtime(spec("m2", "microvm"), Plan(CreateKind.WARM), no_gate)
        assert (claimed.kind, claimed.name) == (CreateKind.WARM, fresh)
