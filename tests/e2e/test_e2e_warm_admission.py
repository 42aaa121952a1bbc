"""The warm-pool refill through admission (SPEC W3), with the real substrate on the
API-server emulator and the real admission service over real sockets: each warm pod's
creation takes a cluster token and a node slot, the refill backs off when admission keeps
them for activations, a claim of a paid pod does not pay the cluster bucket again, and a
burst of activations racing the refill gets what the refill must leave it."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc.aio
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from turnstile_admission.app import create_app as create_admission
from turnstile_admission.keys import AdmissionKeys
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import KeySet, Resolver
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform import peers
from turnstile_platform.leader import LeaderElector
from turnstile_substrate.admission_client import AdmissionClient
from turnstile_substrate.kubernetes import KubernetesSettings, KubernetesSubstrate
from turnstile_substrate.kubernetes.template import ANNOTATION_WARM_PAID
from turnstile_substrate.kubernetes.tier_runtime import TierRuntime
from turnstile_substrate.runtime import LABEL_POOL, LABEL_SANDBOX_ID
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.eventually import eventually
from turnstile_testing.kube_emulator import KubeEmulator

from .kube_stack import (
    NAMESPACE,
    KubeServices,
    activate_for_acme,
    common_settings,
    kube_services,
)

ACME = common_pb2.ActivationClient(client_id="acme")
USAGE = admission_pb2.GetUsageRequest(client=ACME)


def refusals(reason: str) -> float:
    labels = {"tier": "container", "reason": reason}
    return REGISTRY.get_sample_value("turnstile_substrate_warm_refill_refusals_total", labels) or 0


def warm_pods(stack: KubeServices) -> list[dict[str, object]]:
    return [
        p
        for p in stack.kube.pods(NAMESPACE)
        if LABEL_POOL in (p["metadata"].get("labels") or {})
        and LABEL_SANDBOX_ID not in (p["metadata"].get("labels") or {})
    ]


def stack_env(monkeypatch: pytest.MonkeyPatch, warm_pool_size: int) -> None:
    monkeypatch.setenv("TURNSTILE_TIERS", "container")
    monkeypatch.setenv("TURNSTILE_K8S_NODES", '["node-a"]')
    monkeypatch.setenv(
        "TURNSTILE_K8S_TIER_RUNTIMES", json.dumps({"container": {"warm_pool_size": warm_pool_size}})
    )
    monkeypatch.setenv("TURNSTILE_K8S_WARM_POOL_INTERVAL_S", "0.1")
    monkeypatch.setenv("TURNSTILE_K8S_WARM_REQUIRE_RUNNING", "false")
    monkeypatch.setenv("TURNSTILE_K8S_WARM_CLAIM_SPREAD", "1")


#: ``warm_stack(admission_settings, on_kube=None)``: the stack and an admission stub.
WarmStack = Callable[..., contextlib.AbstractAsyncContextManager[tuple[KubeServices, Any]]]


@pytest.fixture
def warm_stack(
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    redis: aioredis.Redis,
) -> WarmStack:
    """The Kubernetes stack with admission's clock frozen before it starts and slow
    buckets (a bucket's key expires in real time once it would have refilled, frozen
    clock or not), so token counts are exact; ``on_kube`` as ``kube_services``'."""

    async def freeze() -> None:
        await redis.set(AdmissionKeys(redis_prefix).test_clock, 1_000_000)

    @contextlib.asynccontextmanager
    async def start(
        admission: dict[str, Any], on_kube: Callable[[KubeEmulator], object] | None = None
    ) -> AsyncIterator[tuple[KubeServices, Any]]:
        slow = {"cluster_rate_per_s": 0.001, "default_rate_per_s": 0.001}
        settings = {**admission, "test_clock": True, "rate": {**slow, **admission.get("rate", {})}}
        async with (
            kube_services(
                redis_url,
                redis_prefix,
                database_url,
                monkeypatch,
                admission=settings,
                before_admission=freeze,
                on_kube=on_kube,
            ) as stack,
            grpc.aio.insecure_channel(stack.admission.address) as channel,
        ):
            yield stack, admission_pb2_grpc.AdmissionServiceStub(channel)

    return start


async def test_warm_pods_take_node_slots_and_tokens_through_admission_and_a_claim_pays_once(
    warm_stack: WarmStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    stack_env(monkeypatch, warm_pool_size=3)
    node_refusals = refusals("node_slots")
    # 4 slots, 1 kept spare: the refill may hold 3, a cold create still finds one.
    async with warm_stack({"slots": {"default_per_node": 4}, "warm": {"spare_slots": 1}}) as (
        stack,
        admission,
    ):

        async def slots_held() -> dict[str, int]:
            return dict((await admission.GetUsage(USAGE)).node_slots_held)

        async def three_slots_held() -> bool:
            return await slots_held() == {"node-a": 3}

        await eventually(lambda: len(warm_pods(stack)) == 3, what="three warm pods")
        await eventually(three_slots_held, what="three warm pods' slots held")
        for pod in warm_pods(stack):
            assert pod["metadata"]["annotations"][ANNOTATION_WARM_PAID] == "true"  # type: ignore[index]
        before = await admission.GetUsage(USAGE)
        assert before.cluster_tokens == before.cluster_capacity - 3

        async with grpc.aio.insecure_channel(stack.substrates[0].address) as sub_channel:
            substrate = substrate_pb2_grpc.SubstrateServiceStub(sub_channel)
            claimed = await activate_for_acme(substrate, "sb-1")
            assert isinstance(claimed, substrate_pb2.ActivateResponse)
            assert claimed.outcome == substrate_pb2.OUTCOME_WARM_CLAIMED
            after = await admission.GetUsage(USAGE)
            # The claim paid its key's bucket; its cluster token went back.
            assert after.cluster_tokens == before.cluster_tokens
            assert after.client_tokens == before.client_tokens - 1
            # The claimed pod keeps its slot: the refill may not take the spare one.
            await eventually(
                lambda: refusals("node_slots") > node_refusals, what="a node-slot refusal"
            )
            assert await slots_held() == {"node-a": 3}
            assert len(warm_pods(stack)) == 2
            # The sandbox stops: its pod's slot is released, and the refill refills.
            await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))
            await eventually(lambda: len(warm_pods(stack)) == 3, what="the pool refilled")
            await eventually(three_slots_held, what="the new pod's slot, the old one's freed")
            refilled = await admission.GetUsage(USAGE)
            assert refilled.cluster_tokens == before.cluster_tokens - 1


async def test_a_failed_warm_create_gives_its_token_and_slot_back(
    warm_stack: WarmStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The API server refuses the first two warm creates: their holds are cancelled, so
    the pool of 2 that follows holds 2 slots and spent 2 tokens, not 4."""
    stack_env(monkeypatch, warm_pool_size=2)

    def refuse_two_creates(kube: KubeEmulator) -> None:
        kube.inject_failure(
            422, method="POST", path=f"/api/v1/namespaces/{NAMESPACE}/pods", times=2
        )

    async with warm_stack({}, on_kube=refuse_two_creates) as (stack, admission):

        async def settled() -> bool:
            usage = await admission.GetUsage(USAGE)
            return len(warm_pods(stack)) == 2 and dict(usage.node_slots_held) == {"node-a": 2}

        await eventually(settled, what="two warm pods made, two slots held")
        usage = await admission.GetUsage(USAGE)
        assert usage.cluster_tokens == usage.cluster_capacity - 2


async def test_a_burst_of_activations_racing_the_refill_keeps_the_reserve_and_pays_once_a_pod(
    warm_stack: WarmStack, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A pool of 10 wanted, a cluster bucket of 12 that keeps 6 for activations: the
    refill stops at 6 pods; 12 activations race it and the refill's replacements. At
    least 6 get a runtime, and every pod ever made spent exactly one token."""
    stack_env(monkeypatch, warm_pool_size=10)
    monkeypatch.setenv("TURNSTILE_K8S_NODES", "[]")
    async with warm_stack(
        {
            "rate": {"cluster_burst": 12},
            "warm": {"cluster_reserve": 0.5},
            "cap": {"default_cap": 100},
            "concurrency": {"default_limit": 100},
        }
    ) as (stack, admission):
        await eventually(
            lambda: refusals("cluster_bucket") > 0 and len(warm_pods(stack)) == 6,
            what="the refill stopped at the reserve",
        )
        async with grpc.aio.insecure_channel(stack.substrates[0].address) as sub_channel:
            substrate = substrate_pb2_grpc.SubstrateServiceStub(sub_channel)
            results = await asyncio.gather(
                *(activate_for_acme(substrate, f"sb-{i}") for i in range(12))
            )
        ran = [r for r in results if isinstance(r, substrate_pb2.ActivateResponse)]
        assert len(ran) >= 6
        usage = await admission.GetUsage(USAGE)
        assert usage.cluster_tokens == 12 - len(stack.kube.pods(NAMESPACE))


async def test_a_new_leader_releases_the_slots_of_paid_pods_its_predecessor_made(
    redis_url: str, redis_prefix: str
) -> None:
    """Two substrate replicas elect a leader on the emulator; the first fills the pool
    through admission, then hands over. A paid pod that goes afterwards has its slot
    released by the new leader, so the refill's replacement finds it (3 slots, 2 pods)."""
    async with KubeEmulator(bookmark_interval=0.05) as kube:
        admission_app = await create_admission(
            AdmissionSettings.model_validate(
                {
                    **common_settings(redis_url, redis_prefix),
                    "port": 0,
                    "slots": {"default_per_node": 3},
                    "warm": {"spare_slots": 0},
                }
            )
        )
        await admission_app.start()
        client = AdmissionClient(
            peers.admission(SubstrateSettings(admission_addr=admission_app.address), None),
            retry_after_s=1.0,
            timeout_s=5.0,
        )
        settings = KubernetesSettings(
            api_host=kube.url,
            namespace=NAMESPACE,
            nodes=("node-a",),
            warm_pool_interval_s=0.05,
            warm_require_running=False,
            tier_runtimes={"default": TierRuntime(warm_pool_size=2)},
        )
        async with contextlib.AsyncExitStack() as stack:
            stack.push_async_callback(admission_app.stop)
            stack.push_async_callback(client.close)
            electors, replicas, tasks = [], [], []
            for i in range(2):
                api = await stack.enter_async_context(kube.api_client())
                elector = LeaderElector(
                    api,
                    namespace=NAMESPACE,
                    lease_name="substrate",
                    identity=f"r{i}",
                    lease_duration_s=3,
                    renew_deadline_s=2,
                    retry_period_s=0.25,
                )
                replica = KubernetesSubstrate(
                    settings,
                    Resolver(KeySet(version=1, allowlist=frozenset({"acme"}))),
                    leadership=elector,
                    admission=client,
                )
                await replica.start()
                stack.push_async_callback(replica.close)
                electors.append(elector)
                replicas.append(replica)
            channel = await stack.enter_async_context(
                grpc.aio.insecure_channel(admission_app.address)
            )
            admission = admission_pb2_grpc.AdmissionServiceStub(channel)

            async def pool_and_slots(pods: int, slots: int) -> bool:
                usage = await admission.GetUsage(USAGE)
                return len(kube.pods(NAMESPACE)) == pods and dict(usage.node_slots_held) == {
                    "node-a": slots
                }

            tasks.append(asyncio.create_task(electors[0].run()))
            await electors[0].wait_leading()
            tasks.append(asyncio.create_task(electors[1].run()))
            try:
                await eventually(lambda: pool_and_slots(2, 2), what="the first leader's pool")
                tasks[0].cancel()  # the first leader steps down and releases its lease
                await electors[1].wait_leading()
                gone = kube.pods(NAMESPACE)[0]["metadata"]["name"]
                kube.delete_pod(NAMESPACE, gone)
                await eventually(
                    lambda: pool_and_slots(2, 2), what="the slot released, the pod replaced"
                )
                assert gone not in {p["metadata"]["name"] for p in kube.pods(NAMESPACE)}
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
