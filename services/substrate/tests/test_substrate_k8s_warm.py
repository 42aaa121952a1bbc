"""Warm-pool claims (SPEC S6) against the API-server emulator: optimistic adoption, lost
races, invalidation of any failed adoption, refill and trim."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import AsyncExitStack
from typing import TYPE_CHECKING, Any

import pytest
from prometheus_client import REGISTRY

from turnstile_substrate.kubernetes import KubernetesSettings, KubernetesSubstrate, template
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TEMPLATE,
    LABEL_TIER,
    MANAGED_BY,
    CreateKind,
    Plan,
    RuntimeSpec,
)
from turnstile_testing.kube_emulator import KubeEmulator, PodFilter

if TYPE_CHECKING:
    from conftest import StartSubstrate

NS = "sandboxes"
#: How long an exactly-once check waits for a second event that must not come.
NO_MORE_WINDOW_S = 1.0


def warm_names(kube: KubeEmulator, tier: str = "default") -> list[str]:
    return [
        p["metadata"]["name"]
        for p in kube.pods(NS)
        if (labels := p["metadata"].get("labels") or {}).get(LABEL_POOL)
        and labels.get(LABEL_TIER) == tier
        and LABEL_SANDBOX_ID not in labels
    ]


async def until(sub: KubernetesSubstrate, condition: Callable[[], bool]) -> None:
    await sub.reflector.wait_until(condition, 5)


async def warm_ready(sub: KubernetesSubstrate, kube: KubeEmulator, count: int) -> None:
    """Wait until the emulator has ``count`` warm pods and the cache shows all of them."""
    await until(
        sub,
        lambda: (
            len(warm_names(kube)) == count
            and sorted(p.name for p in sub.index.warm("default")) == sorted(warm_names(kube))
        ),
    )


async def no_gate() -> None:
    return None


def invalidations(reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "turnstile_substrate_warm_invalidations_total", {"tier": "default", "reason": reason}
    )
    return value or 0.0


def spec(sandbox: str, client: str | None = "acme") -> RuntimeSpec:
    return RuntimeSpec(sandbox_id=sandbox, tier="default", client_label=client)


async def test_refill_keeps_each_tier_at_its_configured_size(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(
        kube, tier_runtimes={"default": {"warm_pool_size": 2}, "gpu": {"warm_pool_size": 1}}
    ) as sub:
        await warm_ready(sub, kube, 2)
        await until(sub, lambda: len(warm_names(kube, "gpu")) == 1)
        for obj in kube.pods(NS):
            labels = obj["metadata"]["labels"]
            assert labels[LABEL_MANAGED_BY] == MANAGED_BY
            assert LABEL_SANDBOX_ID not in labels
            assert LABEL_CLIENT_ID not in labels
        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.WARM), no_gate)
        assert runtime.kind is CreateKind.WARM
        await warm_ready(sub, kube, 2)
        assert len(kube.pods(NS)) == 4


async def test_a_claim_adopts_a_warm_pod_by_a_versioned_label_patch(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 1}}) as sub:
        await warm_ready(sub, kube, 1)
        [name] = warm_names(kube)
        assert sub.plan(spec("s1")) == Plan(CreateKind.WARM)
        runtime = await sub.ensure_runtime(spec("s1"), sub.plan(spec("s1")), no_gate)
        assert (runtime.kind, runtime.name, runtime.sandbox_id, runtime.client_label) == (
            CreateKind.WARM,
            name,
            "s1",
            "acme",
        )
        pod = kube.pod(NS, name)
        assert pod is not None
        labels = pod["metadata"]["labels"]
        assert labels[LABEL_SANDBOX_ID] == "s1"
        assert labels[LABEL_CLIENT_ID] == "acme"
        assert LABEL_POOL not in labels
        patches = [r for r in kube.requests if r.method == "PATCH"]
        assert len(patches) == 1
        assert patches[0].content_type == "application/strategic-merge-patch+json"


async def test_a_claim_for_a_null_record_adopts_without_a_client_label(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 1}}) as sub:
        await warm_ready(sub, kube, 1)
        runtime = await sub.ensure_runtime(spec("s1", None), Plan(CreateKind.WARM), no_gate)
        pod = kube.pod(NS, runtime.name)
        assert pod is not None
        assert LABEL_CLIENT_ID not in pod["metadata"]["labels"]
        assert runtime.client_label is None


async def test_two_replicas_claiming_one_warm_pod_one_wins_and_the_loser_still_gets_a_sandbox(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    async with AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(
                substrate(kube, tier_runtimes={"default": {"warm_pool_size": 1}})
            )
            for _ in range(2)
        ]
        for replica in replicas:
            await warm_ready(replica, kube, 1)
        [contested] = warm_names(kube)
        before = invalidations("conflict")

        # Both claims pass their cap gate only once both have reserved the pod, so both
        # patches carry the same resourceVersion: a real race, settled by the API server.
        arrived = 0
        both = asyncio.Event()

        async def gate() -> None:
            nonlocal arrived
            arrived += 1
            if arrived == 2:
                both.set()
            await both.wait()

        async def claim(replica: KubernetesSubstrate, sandbox: str) -> Any:
            assert replica.pool.claimable("default") is not None
            assert replica.pool.claimable("default").name == contested  # type: ignore[union-attr]
            return await replica.ensure_runtime(spec(sandbox), Plan(CreateKind.WARM), gate)

        first, second = await asyncio.gather(claim(replicas[0], "s1"), claim(replicas[1], "s2"))
        winner, loser = (first, second) if first.name == contested else (second, first)
        losing_replica = replicas[0] if loser is first else replicas[1]
        assert winner.name == contested
        assert winner.kind is CreateKind.WARM
        assert loser.name != contested  # the loser got another pod: the next warm one or cold
        assert invalidations("conflict") == before + 1

        # the contested pod is the winner's sandbox now: left alone, labels intact
        pod = kube.pod(NS, contested)
        assert pod is not None
        assert pod["metadata"]["labels"][LABEL_SANDBOX_ID] == winner.sandbox_id
        loser_pod = kube.pod(NS, loser.name)
        assert loser_pod is not None
        assert loser_pod["metadata"]["labels"][LABEL_SANDBOX_ID] == loser.sandbox_id
        # and the loser never offers it again
        claimable = losing_replica.pool.claimable("default")
        assert claimable is None or claimable.name != contested


@pytest.mark.parametrize(
    ("status", "reason"), [(409, "conflict"), (500, "error"), (422, "error"), (404, "not_found")]
)
async def test_a_failed_adoption_patch_discards_the_pod_and_the_claim_takes_the_next(
    kube: KubeEmulator, substrate: StartSubstrate, status: int, reason: str
) -> None:
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 2}}) as sub:
        await warm_ready(sub, kube, 2)
        first = next(sub.index.warm("default")).name
        kube.inject_failure(status, method="PATCH", path=f"/api/v1/namespaces/{NS}/pods/{first}")
        before = invalidations(reason)
        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.WARM), no_gate)
        assert runtime.kind is CreateKind.WARM
        assert runtime.name != first
        assert kube.pod(NS, first) is None  # discarded, never returned to the pool
        assert invalidations(reason) == before + 1


async def test_an_adoption_whose_patch_landed_but_failed_for_the_caller_is_discarded(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 1}}) as sub:
        await warm_ready(sub, kube, 1)
        [name] = warm_names(kube)
        pod = next(sub.index.warm("default"))
        reserved = sub.pool.reserve("default")
        assert reserved == pod

        # The claim is cancelled the moment the API server receives its patch, which it
        # then applies: the caller never learns of its success. The pod now carries the
        # sandbox's labels, and must not survive as this sandbox's nor go back to the pool.
        history = kube.store.subscribe(PodFilter(namespace=NS), str(kube.resource_version))
        task = asyncio.create_task(sub.pool.adopt(pod, spec("s1")))

        def cancel_on_arrival(path: str) -> bool:
            if path.endswith(f"/pods/{name}"):
                task.cancel()
            return False  # never fails the request

        kube.inject_failure(500, method="PATCH", path=cancel_on_arrival)
        with pytest.raises(asyncio.CancelledError):
            await task
        await until(sub, lambda: kube.pod(NS, name) is None)
        kube.store.unsubscribe(history)
        states = []
        while not history.queue.empty():
            event = history.queue.get_nowait()
            assert not isinstance(event, str)
            meta = event.pod.obj["metadata"]
            if meta["name"] == name:  # the refill loop may have added a replacement meanwhile
                states.append((event.type, meta["labels"].get(LABEL_SANDBOX_ID)))
        # the patch did land (the pod became s1's) before the claim discarded it
        assert states == [("MODIFIED", "s1"), ("DELETED", "s1")]


async def test_a_pod_whose_discard_fails_is_never_offered_again_and_is_deleted_later(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 2}}) as sub:
        await warm_ready(sub, kube, 2)
        first = next(sub.index.warm("default")).name
        path = f"/api/v1/namespaces/{NS}/pods/{first}"
        kube.inject_failure(500, method="PATCH", path=path)
        kube.inject_failure(500, method="DELETE", path=path, times=2)
        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.WARM), no_gate)
        assert runtime.name != first
        # still there after the failed discard, but never offered
        claimable = sub.pool.claimable("default")
        assert claimable is None or claimable.name != first
        # the refill loop retries the discard until the pod is gone
        await until(sub, lambda: kube.pod(NS, first) is None)


async def test_an_exhausted_pool_falls_back_to_a_cold_create(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 1}}) as sub:
        await warm_ready(sub, kube, 1)
        [name] = warm_names(kube)
        kube.inject_failure(409, method="PATCH", path=f"/api/v1/namespaces/{NS}/pods/{name}")
        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.WARM), no_gate)
        assert runtime.kind is CreateKind.COLD
        pod = kube.pod(NS, runtime.name)
        assert pod is not None
        assert pod["metadata"]["labels"][LABEL_SANDBOX_ID] == "s1"


async def test_only_running_warm_pods_are_claimable_by_default(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(
        kube, tier_runtimes={"default": {"warm_pool_size": 1}}, warm_require_running=True
    ) as sub:
        await warm_ready(sub, kube, 1)
        [name] = warm_names(kube)
        assert sub.plan(spec("s1")).kind is CreateKind.COLD
        kube.set_pod_phase(NS, name, "Running", ready=True)
        await until(sub, lambda: sub.plan(spec("s1")).kind is CreateKind.WARM)


async def test_excess_warm_pods_are_trimmed_to_the_configured_size(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    for i in range(4):
        kube.create_pod(
            NS,
            {
                "metadata": {
                    "name": f"extra-{i}",
                    "labels": {
                        LABEL_POOL: "warm",
                        LABEL_TIER: "default",
                        LABEL_MANAGED_BY: MANAGED_BY,
                        LABEL_TEMPLATE: template.template_hash(KubernetesSettings(), "default"),
                    },
                },
                "spec": {"containers": [{"name": "c", "image": "i"}]},
            },
        )
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 1}}) as sub:
        await warm_ready(sub, kube, 1)
        # every replica picks the same victims: the highest names
        assert warm_names(kube) == ["extra-0"]
        await sub.pool.reconcile()  # a second pass against the trimmed view, run to its end
        assert len(warm_names(kube)) == 1
        # ...and no later pass trims again: no deletion within a generous window
        # (the reflector wakes this check on every watch event).
        with pytest.raises(TimeoutError):
            await sub.reflector.wait_until(lambda: len(warm_names(kube)) != 1, NO_MORE_WINDOW_S)


async def test_concurrent_claims_in_one_replica_never_race_for_the_same_pod(
    kube: KubeEmulator,
    substrate: StartSubstrate,
) -> None:
    async with substrate(kube, tier_runtimes={"default": {"warm_pool_size": 4}}) as sub:
        await warm_ready(sub, kube, 4)
        await sub.pool.stop()  # hold the pool at these four pods
        warm = set(warm_names(kube))
        before = sum(invalidations(r) for r in ("conflict", "error", "not_found"))
        runtimes = await asyncio.gather(
            *(
                sub.ensure_runtime(spec(f"s{i}"), sub.plan(spec(f"s{i}")), no_gate)
                for i in range(10)
            )
        )
        assert len({r.name for r in runtimes}) == 10
        assert {r.name for r in runtimes if r.kind is CreateKind.WARM} == warm
        assert sum(r.kind is CreateKind.COLD for r in runtimes) == 6
        assert sum(invalidations(r) for r in ("conflict", "error", "not_found")) == before
