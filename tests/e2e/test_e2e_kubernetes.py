"""The real admission and substrate services on the Kubernetes substrate, against
the API-server emulator: the cap (SPEC P1, S4, S5) across the whole path.

Admission counts a key's live sandboxes through the substrate's reflector and
its own pending set; the substrate creates pods labelled with the client id and
runs the cap again before each pod. Nothing here is a double of either service.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_admission.keys import AdmissionKeys
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.errors import RichError
from turnstile_substrate.app import create_app as create_substrate
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.runtime import LABEL_CLIENT_ID, LABEL_SANDBOX_ID
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator import KubeEmulator

from .kube_stack import NAMESPACE, activate_for_acme, kube_services

CAP = 10


@dataclass
class Stack:
    kube: KubeEmulator
    substrate: substrate_pb2_grpc.SubstrateServiceAsyncStub
    admission: admission_pb2_grpc.AdmissionServiceAsyncStub
    #: Further substrate replicas (``running_stack(replicas=N)``), same cluster and database.
    replicas: tuple[substrate_pb2_grpc.SubstrateServiceAsyncStub, ...] = ()

    def pods(self) -> list[dict[str, object]]:
        return list(self.kube.pods(NAMESPACE))


@contextlib.asynccontextmanager
async def running_stack(
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    replicas: int = 1,
    **admission: object,
) -> AsyncIterator[Stack]:
    """Both services on the emulator (``replicas`` substrate processes); ``admission``
    overrides admission settings."""
    async with (
        kube_services(
            redis_url,
            redis_prefix,
            database_url,
            monkeypatch,
            replicas=replicas,
            substrate={"health_check_interval_s": 0.1},
            admission={
                "cap": {"default_cap": CAP},
                "rate": {"default_burst": 1000, "cluster_burst": 1000},
                "concurrency": {"default_limit": 1000},
                **admission,
            },
        ) as services,
        contextlib.AsyncExitStack() as channels,
    ):
        subs = [
            substrate_pb2_grpc.SubstrateServiceStub(
                await channels.enter_async_context(grpc.aio.insecure_channel(app.address))
            )
            for app in services.substrates
        ]
        adm = await channels.enter_async_context(
            grpc.aio.insecure_channel(services.admission.address)
        )
        yield Stack(
            services.kube, subs[0], admission_pb2_grpc.AdmissionServiceStub(adm), tuple(subs[1:])
        )


@pytest.fixture
async def stack(
    redis_url: str, redis_prefix: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Stack]:
    async with running_stack(redis_url, redis_prefix, database_url, monkeypatch) as running:
        yield running


async def _activate(stack: Stack, sandbox_id: str) -> substrate_pb2.ActivateResponse | RichError:
    return await activate_for_acme(stack.substrate, sandbox_id)


async def test_a_hundred_concurrent_activations_under_a_cap_of_ten_leave_exactly_ten_pods(
    stack: Stack,
) -> None:
    results = await asyncio.gather(*(_activate(stack, f"sb-{n:03}") for n in range(100)))

    created = {
        r.sandbox.sandbox_id for r in results if isinstance(r, substrate_pb2.ActivateResponse)
    }
    refused = [r for r in results if isinstance(r, RichError)]
    assert len(created) == CAP, [str(r) for r in refused[:3]]
    assert {(e.code, e.reason) for e in refused} == {
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAP_EXCEEDED")
    }
    pods = stack.pods()
    labels = [p["metadata"]["labels"] for p in pods]  # type: ignore[index]
    assert {lab[LABEL_SANDBOX_ID] for lab in labels} == created
    assert {lab[LABEL_CLIENT_ID] for lab in labels} == {"acme"}

    # Once the reflector has seen every pod, each sandbox counts exactly once:
    # live, and no longer pending (SPEC P6: no systematic drift).
    usage = await _settled_usage(stack, live=CAP)
    assert (usage.live, usage.pending, usage.in_flight) == (CAP, 0, 0)
    # And the cap holds afterwards: one more is refused.
    again = await _activate(stack, "sb-late")
    assert isinstance(again, RichError)
    assert again.reason == "CAP_EXCEEDED"
    assert len(stack.pods()) == CAP


async def test_a_full_cycle_leaves_no_drift_the_freed_room_is_exactly_reusable(
    stack: Stack,
) -> None:
    first = await asyncio.gather(*(_activate(stack, f"a-{n}") for n in range(CAP)))
    assert all(isinstance(r, substrate_pb2.ActivateResponse) for r in first)
    await _settled_usage(stack, live=CAP)
    for n in range(0, CAP, 2):
        await stack.substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=f"a-{n}"))
    await _settled_usage(stack, live=CAP // 2)
    second = await asyncio.gather(*(_activate(stack, f"b-{n}") for n in range(CAP)))
    admitted = [r for r in second if isinstance(r, substrate_pb2.ActivateResponse)]
    assert len(admitted) == CAP // 2  # exactly the room freed, no more, no less
    usage = await _settled_usage(stack, live=CAP)
    assert (usage.pending, usage.in_flight) == (0, 0)
    assert len(stack.pods()) == CAP


async def _settled_usage(stack: Stack, *, live: int) -> admission_pb2.GetUsageResponse:
    """GetUsage once the reflector shows ``live`` pods (it follows the API server's
    watch, another task's progress: polled with a deadline)."""
    request = admission_pb2.GetUsageRequest(client=common_pb2.ActivationClient(client_id="acme"))
    async with asyncio.timeout(15):
        while True:
            usage = await stack.admission.GetUsage(request)
            if usage.HasField("live") and usage.live == live:
                return usage
            await asyncio.sleep(0.05)


async def test_the_substrate_is_not_serving_until_its_reflector_has_listed(
    redis_url: str, redis_prefix: str, database_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    await asyncio.to_thread(apply_migrations, database_url)
    async with KubeEmulator(bookmark_interval=0.2) as kube:
        monkeypatch.setenv("TURNSTILE_K8S_API_HOST", kube.url)
        monkeypatch.setenv("TURNSTILE_K8S_NAMESPACE", NAMESPACE)
        monkeypatch.setenv("TURNSTILE_K8S_RELIST_BACKOFF_S", "0.05")
        # The API server refuses the reflector's lists until the fault is lifted.
        fault = kube.inject_failure(503, method="GET", watch=False, times=10_000)
        app = await create_substrate(
            SubstrateSettings.model_validate(
                {
                    "host": "127.0.0.1",
                    "port": 0,
                    "metrics_port": 0,
                    "redis_url": redis_url,
                    "redis_prefix": redis_prefix,
                    "substrate_kind": "kubernetes",
                    "database_url": database_url,
                    "health_check_interval_s": 0.05,
                    "shutdown_grace_s": 1.0,
                    "log_format": "text",
                }
            )
        )
        await app.start()
        try:
            async with grpc.aio.insecure_channel(app.address) as channel:
                watch = health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest(service="turnstile.substrate.v1.SubstrateService")
                )
                first = await watch.read()
                assert first.status == health_pb2.HealthCheckResponse.NOT_SERVING
                count = await substrate_pb2_grpc.SubstrateServiceStub(channel).CountLiveSandboxes(
                    substrate_pb2.CountLiveSandboxesRequest(key="acme")
                )
                assert count.unknown.reason == substrate_pb2.UNKNOWN_REASON_NOT_SYNCED
                kube.clear_failures()
                async with asyncio.timeout(10):
                    while (await watch.read()).status != health_pb2.HealthCheckResponse.SERVING:
                        pass
                watch.cancel()
            assert fault.hits >= 1  # it was refused, not merely not yet tried
        finally:
            await app.stop()


async def test_a_failed_pod_create_returns_everything_admission_took(
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    redis: aioredis.Redis,
) -> None:
    """The substrate's compensation against the real admission service: the pod
    create fails after Admit took tokens, an in-flight lease, a pending entry and
    a node slot, and GetUsage shows every one of them returned."""
    monkeypatch.setenv("TURNSTILE_K8S_NODES", '["node-a"]')
    async with running_stack(
        redis_url, redis_prefix, database_url, monkeypatch, test_clock=True
    ) as stack:
        await redis.set(AdmissionKeys(redis_prefix).test_clock, 1_000_000)  # no refill
        request = admission_pb2.GetUsageRequest(
            client=common_pb2.ActivationClient(client_id="acme")
        )
        created = await _activate(stack, "sb-ok")  # the path takes a node slot...
        assert isinstance(created, substrate_pb2.ActivateResponse)
        before = await stack.admission.GetUsage(request)
        assert dict(before.node_slots_held) == {"node-a": 1}
        assert before.client_tokens == before.client_capacity - 1
        assert before.in_flight == 0

        stack.kube.inject_failure(500, method="POST", path=f"/api/v1/namespaces/{NAMESPACE}/pods")
        failed = await _activate(stack, "sb-fail")

        assert isinstance(failed, RichError)
        assert failed.code == grpc.StatusCode.UNAVAILABLE
        assert failed.reason == "RUNTIME_FAILED"
        assert failed.retryable
        after = await stack.admission.GetUsage(request)
        assert dict(after.node_slots_held) == {"node-a": 1}  # sb-ok's, none for sb-fail
        assert after.client_tokens == before.client_tokens
        assert after.cluster_tokens == before.cluster_tokens
        assert after.in_flight == 0
        keys = AdmissionKeys(redis_prefix)
        assert await redis.zscore(keys.pending("acme"), "sb-fail") is None
        assert after.pending <= before.pending  # sb-ok's may have been seen live since
        assert [p["metadata"]["labels"][LABEL_SANDBOX_ID] for p in stack.pods()] == ["sb-ok"]  # type: ignore[index]


async def test_a_client_gone_mid_activation_leaves_no_runtime_and_its_hold_cancelled(
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    redis: aioredis.Redis,
) -> None:
    """The client cancels its Activate once the pod create has reached the API
    server (the runtime exists), and retries on the other substrate replica at
    once: the first replica removes its pod and cancels its hold, the retry waits
    for the sandbox's lock and creates exactly one runtime."""
    async with running_stack(
        redis_url, redis_prefix, database_url, monkeypatch, replicas=2, test_clock=True
    ) as stack:
        await redis.set(AdmissionKeys(redis_prefix).test_clock, 1_000_000)  # no refill
        request = admission_pb2.GetUsageRequest(
            client=common_pb2.ActivationClient(client_id="acme")
        )
        before = await stack.admission.GetUsage(request)
        activate = substrate_pb2.ActivateRequest(
            sandbox_id="sb-1", client=common_pb2.ActivationClient(client_id="acme")
        )
        first = stack.substrate.Activate(activate)
        created = asyncio.Event()

        def cancel_on_arrival(path: str) -> bool:
            if path == f"/api/v1/namespaces/{NAMESPACE}/pods" and not created.is_set():
                first.cancel()
                created.set()
            return False  # the create goes through; only its caller is gone

        stack.kube.inject_failure(500, method="POST", path=cancel_on_arrival, times=1000)
        with pytest.raises(asyncio.CancelledError):
            await first
        assert created.is_set()

        retried = await stack.replicas[0].Activate(activate)

        assert retried.outcome == substrate_pb2.OUTCOME_CREATED
        names = [p["metadata"]["name"] for p in stack.pods()]  # type: ignore[index]
        assert names == [retried.sandbox.runtime_name]  # the first replica's pod is gone
        after = await stack.admission.GetUsage(request)
        # One activation's worth taken: the first hold was cancelled, the retry's committed.
        assert after.client_tokens == before.client_tokens - 1
        assert after.in_flight == 0
