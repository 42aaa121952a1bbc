"""The cap under a burst, with the shipped settings (SPEC S4): the real admission
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

from turnstile_clientkeys import LiveCountKeys
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_contracts import substrate_pb2, substrate_pb2_grpc
from turnstile_platform.errors import RichError
from turnstile_testing.eventually import eventually
from turnstile_testing.kube_emulator import KubeEmulator

from .kube_stack import API_ONLY, NAMESPACE, activate_for_acme, kube_services

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
    counted = request.param == "counted"

    async def until_counted() -> None:
        if counted:
            await _until_counted(redis, LiveCountKeys(redis_prefix))

    async with (
        kube_services(
            redis_url,
            redis_prefix,
            database_url,
            monkeypatch,
            cluster=API_ONLY,
            before_admission=until_counted,
            admission={
                # Unavailable: admission reads live counts no leader writes.
                "redis_prefix": redis_prefix if counted else f"{redis_prefix}nobody:",
                "cap": {"default_cap": CAP},
                "rate": {"default_burst": 10_000, "cluster_burst": 10_000},
                "concurrency": {"default_limit": 10_000},
            },
        ) as services,
        grpc.aio.insecure_channel(services.substrates[0].address) as sub,
    ):
        yield Stack(services.kube, substrate_pb2_grpc.SubstrateServiceStub(sub))


async def _until_counted(redis: aioredis.Redis, keys: LiveCountKeys) -> None:
    """The substrate's leader has marked the counts current (another task's work:
    polled, with a generous deadline)."""

    async def counted() -> bool:
        return await redis.get(keys.state) == COUNTED.encode()

    await eventually(counted, timeout_s=15, what="the counts marked current")


async def _activate(stack: Stack, sandbox_id: str) -> substrate_pb2.ActivateResponse | RichError:
    return await activate_for_acme(stack.substrate, sandbox_id)


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
