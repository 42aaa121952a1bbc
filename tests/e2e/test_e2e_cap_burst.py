"""The cap under a burst, with the shipped settings (issue 10): the real admission
and substrate services on the Kubernetes substrate, against the API-server
emulator, and no raised deadline anywhere.

300 concurrent activations of one client with a cap of 7 must leave at most 8
pods (SPEC P6 allows an error of one). When the live count is unavailable
(no substrate leader keeps it current), it is a lower bound of zero: the cap
still refuses on the pending set alone, so the burst still leaves at most 8
pods, never one per caller.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission.app import create_app as create_admission
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import LiveCountKeys
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.errors import RichError, decode
from turnstile_platform.server import GrpcService
from turnstile_substrate.app import create_app as create_substrate
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.processes import free_port

NAMESPACE = "sandboxes"
CAP = 7
BURST = 300


@dataclass
class Stack:
    kube: KubeEmulator
    substrate: substrate_pb2_grpc.SubstrateServiceAsyncStub


@pytest.fixture(params=["counted", "count-unavailable"])
async def stack(
    request: pytest.FixtureRequest,
    redis_url: str,
    redis_prefix: str,
    redis: aioredis.Redis,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Stack]:
    """Admission and substrate with their shipped deadlines; the cap is 7, and the
    rate and concurrency limits are out of the way so the cap alone decides.

    ``count-unavailable``: admission reads live counts that no substrate leader
    keeps (its key prefix is one nobody publishes under: as with no leader, or a
    leader whose marker has run out), so every cap decision has the pending set
    alone.
    """
    await asyncio.to_thread(apply_migrations, database_url)
    async with KubeEmulator(bookmark_interval=0.2) as kube:
        monkeypatch.setenv("TURNSTILE_K8S_API_HOST", kube.url)
        monkeypatch.setenv("TURNSTILE_K8S_NAMESPACE", NAMESPACE)
        admission_port = free_port()
        common: dict[str, object] = {
            "host": "127.0.0.1",
            "metrics_port": 0,
            "redis_url": redis_url,
            "redis_prefix": redis_prefix,
            "client_allowlist": ("acme",),
            "shutdown_grace_s": 1.0,
            "log_format": "text",
        }
        substrate_app = await create_substrate(
            SubstrateSettings.model_validate(
                {
                    **common,
                    "port": 0,
                    "substrate_kind": "kubernetes",
                    "database_url": database_url,
                    "admission_addr": f"127.0.0.1:{admission_port}",
                }
            )
        )
        await substrate_app.start()
        counted = request.param == "counted"
        if counted:
            await _until_counted(redis, LiveCountKeys(redis_prefix))
        admission_app = await create_admission(
            AdmissionSettings.model_validate(
                {
                    **common,
                    "port": admission_port,
                    # Unavailable: admission reads live counts no leader writes.
                    "redis_prefix": redis_prefix if counted else f"{redis_prefix}nobody:",
                    "cap": {"default_cap": CAP},
                    "rate": {"default_burst": 10_000, "cluster_burst": 10_000},
                    "concurrency": {"default_limit": 10_000},
                }
            )
        )
        await admission_app.start()
        apps: list[GrpcService] = [admission_app, substrate_app]
        async with grpc.aio.insecure_channel(substrate_app.address) as sub:
            yield Stack(kube, substrate_pb2_grpc.SubstrateServiceStub(sub))
        for app in apps:
            await app.stop()


async def _until_counted(redis: aioredis.Redis, keys: LiveCountKeys) -> None:
    """The substrate's leader has marked the counts current (another task's work:
    polled, with a generous deadline)."""
    async with asyncio.timeout(15):
        while True:
            if await redis.get(keys.state) == COUNTED.encode():
                return
            await asyncio.sleep(0.02)


async def _activate(stack: Stack, sandbox_id: str) -> substrate_pb2.ActivateResponse | RichError:
    try:
        return await stack.substrate.Activate(
            substrate_pb2.ActivateRequest(
                sandbox_id=sandbox_id, client=common_pb2.ActivationClient(client_id="acme")
            )
        )
    except grpc.aio.AioRpcError as error:
        return decode(error)


async def test_a_burst_of_300_activations_under_a_cap_of_7_leaves_at_most_8_pods(
    stack: Stack,
) -> None:
    results = await asyncio.gather(*(_activate(stack, f"burst-{n:03}") for n in range(BURST)))

    created = [r for r in results if isinstance(r, substrate_pb2.ActivateResponse)]
    refused = [r for r in results if isinstance(r, RichError)]
    pods = list(stack.kube.pods(NAMESPACE))
    assert len(pods) <= CAP + 1, f"{len(pods)} pods for a cap of {CAP}"
    assert len(created) == len(pods)
    assert len(created) >= CAP - 1, [str(r) for r in refused[:3]]
    # Every refusal is the cap's, on the pending set alone if need be: none is an
    # UNAVAILABLE passed off as a decision, none an admission that failed open.
    assert {e.reason for e in refused} == {"CAP_EXCEEDED"}, [str(r) for r in refused[:3]]
