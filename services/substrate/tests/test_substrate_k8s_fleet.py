"""Several substrate replicas on one API server: the warm pool is refilled by the leader
only, creates are idempotent per activation (SPEC F5), claims spread over warm pods."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import pytest

from turnstile_platform.leader import LeaderElector
from turnstile_substrate.kubernetes import KubernetesSubstrate, template
from turnstile_substrate.runtime import LABEL_SANDBOX_ID, CreateKind, Plan, RuntimeSpec
from turnstile_testing.kube_emulator import KubeEmulator

if TYPE_CHECKING:
    from conftest import StartSubstrate

NS = "sandboxes"


async def no_gate() -> None:
    return None


def spec(sandbox: str, generation: int = 0) -> RuntimeSpec:
    return RuntimeSpec(sandbox, "default", "acme", generation=generation)


def pod_posts(kube: KubeEmulator) -> int:
    return sum(1 for r in kube.requests if r.method == "POST" and r.path.endswith("/pods"))


def sandbox_pods(kube: KubeEmulator, sandbox: str) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in kube.pods(NS)
        if (p["metadata"].get("labels") or {}).get(LABEL_SANDBOX_ID) == sandbox
    ]


def warm_full(replica: KubernetesSubstrate, size: int) -> Callable[[], bool]:
    return lambda: sum(1 for _ in replica.index.warm("default")) == size


@contextlib.asynccontextmanager
async def elector(kube: KubeEmulator, identity: str) -> AsyncIterator[LeaderElector]:
    async with kube.api_client() as api:
        yield LeaderElector(
            api,
            namespace=NS,
            lease_name="substrate",
            identity=identity,
            lease_duration_s=3,
            renew_deadline_s=2,
            retry_period_s=0.25,
        )


async def test_only_the_leader_refills_the_warm_pool(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        electors = [await stack.enter_async_context(elector(kube, f"r{i}")) for i in range(3)]
        replicas = [
            await stack.enter_async_context(
                substrate(kube, leadership=e, tier_runtimes={"default": {"warm_pool_size": 4}})
            )
            for e in electors
        ]
        tasks = [asyncio.create_task(e.run()) for e in electors]
        try:
            await replicas[0].reflector.wait_until(
                lambda: sum(1 for _ in replicas[0].index.warm("default")) == 4, 10
            )
            # every replica has seen the pool full; give the others time to (not) act
            for replica in replicas:
                await replica.reflector.wait_until(warm_full(replica, 4), 10)
            await asyncio.sleep(0.5)
            assert sum(1 for e in electors if e.is_leader) == 1
            assert pod_posts(kube) == 4  # one fill, not one per replica
            assert len(kube.pods(NS)) == 4
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_concurrent_creates_of_one_activation_make_one_pod(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube) as first, substrate(kube) as second:
        runtimes = await asyncio.gather(
            *(
                replica.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)
                for replica in (first, second, first, second)
            )
        )

    assert {r.name for r in runtimes} == {template.sandbox_pod_name(first.settings, "s1", 0)}
    assert len(sandbox_pods(kube, "s1")) == 1
    assert pod_posts(kube) == 4  # four attempts, three answered AlreadyExists


async def test_a_create_that_landed_after_its_client_gave_up_is_the_same_runtime(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube) as sub:
        # The earlier attempt's POST landed, but its caller never saw the answer.
        landed = template.sandbox_pod(sub.settings, spec("s1"))
        kube.create_pod(NS, landed)

        runtime = await sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)

    assert runtime.name == landed["metadata"]["name"]
    assert sandbox_pods(kube, "s1") == [runtime.name]


async def test_the_next_activation_gets_a_new_name(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube) as sub:
        first = await sub.ensure_runtime(spec("s1", 0), Plan(CreateKind.COLD), no_gate)
        await sub.stop_runtime("s1")
        second = await sub.ensure_runtime(spec("s1", 1), Plan(CreateKind.COLD), no_gate)

    assert first.name != second.name


async def test_a_name_still_held_by_a_terminating_pod_fails_the_activation(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    # The create waits for the terminating pod to go for the termination grace plus
    # one request timeout before it gives up: short here, so the test does not wait
    # out the 20 s defaults.
    async with substrate(kube, termination_grace_s=0, request_timeout_s=2.0) as sub:
        landed = template.sandbox_pod(sub.settings, spec("s1"))
        landed["metadata"]["finalizers"] = ["test/hold"]
        kube.create_pod(NS, landed)
        kube.delete_pod(NS, landed["metadata"]["name"])  # terminating: held by the finalizer

        with pytest.raises(Exception, match="terminating"):
            await sub.ensure_runtime(spec("s1"), Plan(CreateKind.COLD), no_gate)


async def test_claims_spread_over_the_oldest_warm_pods(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(
        kube, tier_runtimes={"default": {"warm_pool_size": 8}}, warm_claim_spread=8
    ) as sub:
        await sub.reflector.wait_until(lambda: sum(1 for _ in sub.index.warm("default")) == 8, 10)
        await sub.pool.stop()
        chosen = set()
        for _ in range(40):
            pod = sub.pool.reserve("default")
            assert pod is not None
            chosen.add(pod.name)
            sub.pool.release(pod)

    # 40 draws among 8: all on one pod has probability 8**-39
    assert len(chosen) > 1
    assert len(kube.store.all(NS)) == 8
