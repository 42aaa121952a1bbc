"""Sandbox pods on the API-server emulator: labels (SPEC S2), the cap gate before every pod
(SPEC S5), compensation on failure, find/stop."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import pytest

from turnstile_substrate.kubernetes import KubernetesSettings, KubernetesSubstrate, template
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_MANAGED_BY,
    LABEL_NAME,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TEMPLATE,
    LABEL_TIER,
    MANAGED_BY,
    WORKER_NAME,
    CreateKind,
    LiveCount,
    Plan,
    RuntimeSpec,
)
from turnstile_testing.kube_emulator import KubeEmulator, PodFilter

if TYPE_CHECKING:
    from conftest import StartSubstrate

NS = "sandboxes"
PODS = f"/api/v1/namespaces/{NS}/pods"


class CapRefusedError(Exception):
    """What a refusing cap gate raises in these tests."""


def seed_warm(kube: KubeEmulator, name: str) -> None:
    kube.create_pod(
        NS,
        {
            "metadata": {
                "name": name,
                "labels": {
                    LABEL_POOL: "warm",
                    LABEL_TIER: "default",
                    LABEL_MANAGED_BY: MANAGED_BY,
                    # made from the template the substrate fixture's settings give
                    LABEL_TEMPLATE: template.template_hash(KubernetesSettings(), "default"),
                },
            },
            "spec": {"containers": [{"name": "c", "image": "i"}]},
        },
    )


def spec(sandbox: str, client: str | None = "acme", *, restore: bool = False) -> RuntimeSpec:
    return RuntimeSpec(sandbox_id=sandbox, tier="default", client_label=client, restore=restore)


async def no_gate() -> None:
    return None


async def caught_up(sub: KubernetesSubstrate, kube: KubeEmulator) -> None:
    reflector = sub.reflector
    await reflector.wait_until(lambda: reflector.resource_version == str(kube.resource_version), 5)


def pod_writes(kube: KubeEmulator) -> list[str]:
    """The pod-producing requests so far: POST (create) and PATCH (adopt) on pods."""
    return [
        f"{r.method} {r.path}"
        for r in kube.requests
        if r.method in ("POST", "PATCH") and r.path.startswith(PODS)
    ]


async def test_a_cold_pod_carries_the_template_and_the_sandbox_client_tier_labels(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    overrides = {"image": "registry.local/runtime:1", "cpu_limit": "2", "extra_labels": {"a": "b"}}
    async with substrate(kube, **overrides) as sub:
        plan = sub.plan(spec("Sandbox_1"))
        assert plan == Plan(CreateKind.COLD)
        runtime = await sub.ensure_runtime(spec("Sandbox_1"), plan, no_gate)
        assert runtime.kind is CreateKind.COLD
        assert runtime.name.startswith("ts-sandbox-1-")
        pod = kube.pod(NS, runtime.name)
        assert pod is not None
        assert pod["metadata"]["labels"] == {
            LABEL_SANDBOX_ID: "Sandbox_1",
            LABEL_CLIENT_ID: "acme",
            LABEL_TIER: "default",
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_NAME: WORKER_NAME,
            "a": "b",
        }
        [container] = pod["spec"]["containers"]
        assert container["image"] == "registry.local/runtime:1"
        assert container["resources"] == {
            "requests": {"cpu": "250m", "memory": "512Mi"},
            "limits": {"cpu": "2", "memory": "1Gi"},
        }
        await caught_up(sub, kube)
        assert sub.count_live("acme", None, ()) == LiveCount(1)
        assert sub.count_live("acme", "Sandbox_1", ()) == LiveCount(0)


async def test_a_null_record_creates_a_pod_without_a_client_label(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube) as sub:
        runtime = await sub.ensure_runtime(spec("s1", None), Plan(CreateKind.COLD), no_gate)
        pod = kube.pod(NS, runtime.name)
        assert pod is not None
        assert LABEL_CLIENT_ID not in pod["metadata"]["labels"]
        await caught_up(sub, kube)
        assert sub.count_live("unattributed", None, ()) == LiveCount(1)


async def test_a_restore_plans_a_restore_with_the_candidate_nodes_and_marks_the_pod(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    async with substrate(kube, nodes=("n1", "n2")) as sub:
        plan = sub.plan(spec("s1", restore=True))
        assert plan == Plan(CreateKind.RESTORE, ("n1", "n2"))
        runtime = await sub.ensure_runtime(spec("s1", restore=True), plan, no_gate)
        assert runtime.kind is CreateKind.RESTORE
        pod = kube.pod(NS, runtime.name)
        assert pod is not None
        assert pod["metadata"]["annotations"] == {"turnstile.dev/restore": "true"}


async def test_the_cap_gate_runs_before_every_pod_the_substrate_creates(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    for name in ("w1", "w2"):
        seed_warm(kube, name)
    async with substrate(kube) as sub:
        await sub.pool.stop()  # no refill or trim: every pod write below is the claim's
        # two adoptions fail, then a cold create: three pods tried, three gate runs, each
        # gate run before its pod and no pod without its own gate run
        for name in ("w1", "w2"):
            kube.inject_failure(500, method="PATCH", path=f"{PODS}/{name}")
        timeline: list[str] = []

        async def gate() -> None:
            timeline.extend(pod_writes(kube)[len([t for t in timeline if t != "gate"]) :])
            timeline.append("gate")

        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.WARM), gate)
        timeline.extend(pod_writes(kube)[len([t for t in timeline if t != "gate"]) :])
        assert runtime.kind is CreateKind.COLD
        assert timeline == [
            "gate",
            f"PATCH {PODS}/w1",
            "gate",
            f"PATCH {PODS}/w2",
            "gate",
            f"POST {PODS}",
        ]


async def test_a_refusing_cap_gate_creates_no_pod_and_claims_no_warm_pod(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    seed_warm(kube, "w1")
    async with substrate(kube) as sub:
        await sub.pool.stop()  # no refill or trim: every pod write below is the claim's

        async def refuse() -> None:
            raise CapRefusedError

        for plan in (Plan(CreateKind.WARM), Plan(CreateKind.COLD), Plan(CreateKind.RESTORE)):
            with pytest.raises(CapRefusedError):
                await sub.ensure_runtime(spec("s1"), plan, refuse)
        assert pod_writes(kube) == []
        assert [p["metadata"]["name"] for p in kube.pods(NS)] == ["w1"]
        # the warm pod was only reserved, never tried: it is still claimable
        claimable = sub.pool.claimable("default")
        assert claimable is not None
        assert claimable.name == "w1"


async def test_a_refused_create_leaves_no_pod_and_raises(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube) as sub:
        kube.inject_failure(500, method="POST", path=PODS)
        with pytest.raises(Exception, match="500"):
            await sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)
        assert kube.pods(NS) == []


async def test_a_create_cancelled_after_the_server_stored_the_pod_leaves_no_pod(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    async with substrate(kube) as sub:
        task = asyncio.create_task(sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate))

        def cancel_on_arrival(path: str) -> bool:
            task.cancel()
            return False  # the create goes through; only its caller is gone

        kube.inject_failure(500, method="POST", path=cancel_on_arrival)
        with pytest.raises(asyncio.CancelledError):
            await task
        assert kube.pods(NS) == []
        assert any(r.method == "DELETE" for r in kube.requests)


async def test_find_running_answers_from_the_api_server_when_the_cache_has_not_seen_the_pod(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    async with substrate(kube) as sub:
        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)
        # no await between the create's answer and this call's cache lookup
        found = await sub.find_running("s1")
        assert found is not None
        assert found.name == runtime.name
        assert await sub.find_running("s2") is None


async def test_stop_deletes_the_sandboxs_pods_and_find_running_forgets_it_at_once(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    async with substrate(kube) as sub:
        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)
        kube.set_node_name(NS, runtime.name, "node-a")
        await caught_up(sub, kube)
        running = await sub.find_running("s1")
        assert running is not None
        assert running.node == "node-a"
        assert await sub.stop_runtime("s1") is True
        assert await sub.find_running("s1") is None  # even before the cache sees the delete
        # a scheduled pod is deleted gracefully: Terminating for its grace period
        terminating = kube.pod(NS, runtime.name)
        assert terminating is not None
        assert terminating["metadata"]["deletionTimestamp"]
        assert await sub.stop_runtime("s1") is False  # being deleted is not live
        await caught_up(sub, kube)
        assert sub.count_live("acme", None, ()) == LiveCount(0)
        assert await sub.find_running("s1") is None
        kube.finish_termination(NS, runtime.name)  # the kubelet stopped its containers
        assert kube.pods(NS) == []


async def test_the_substrate_never_changes_a_client_id_label_once_set(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    history = kube.store.subscribe(PodFilter(namespace=NS), None)
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 2}}) as sub:
        await sub.reflector.wait_until(lambda: sub.index.warm_count("default") == 2, 5)
        clients = ["acme", None, "globex", "acme"]
        for i, client in enumerate(clients):
            sandbox = f"s{i}"
            plan = sub.plan(spec(sandbox, client))
            await sub.ensure_runtime(spec(sandbox, client), plan, no_gate)
            # activate the same sandboxes again as other clients: already running, untouched
            assert await sub.find_running(sandbox) is not None
        await sub.stop_runtime("s0")
        await sub.ensure_runtime(spec("s0", "globex"), Plan(CreateKind.COLD), no_gate)
        await caught_up(sub, kube)
    kube.store.unsubscribe(history)

    first_client: dict[str, str | None] = {}
    sandbox_of: dict[str, str] = {}
    events = 0
    while not history.queue.empty():
        event = history.queue.get_nowait()
        assert not isinstance(event, str)
        events += 1
        meta = event.pod.obj["metadata"]
        labels = meta.get("labels") or {}
        name = meta["name"]
        if LABEL_SANDBOX_ID in labels:
            # once a pod is a sandbox's, its sandbox and client labels never change
            client = labels.get(LABEL_CLIENT_ID)
            assert first_client.setdefault(name, client) == client
            assert sandbox_of.setdefault(name, labels[LABEL_SANDBOX_ID]) == labels[LABEL_SANDBOX_ID]
        else:
            assert LABEL_CLIENT_ID not in labels
    assert events > 10
    assert sorted(first_client.values(), key=str) == sorted(
        ["acme", None, "globex", "acme", "globex"], key=str
    )
