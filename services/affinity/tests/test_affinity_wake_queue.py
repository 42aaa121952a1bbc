"""Activations on a contended cluster wait their turn in admission's fair queue
(SPEC T7, Q1): the real affinity, substrate (Direct) and admission services, over
gRPC, on real Redis and PostgreSQL. A wake's ``Activate`` carries a wait budget
derived from the Place caller's remaining deadline, so the woken sandbox is
admitted when the cluster bucket refills instead of the wake failing on the first
refusal; an ``Activate`` that waited says where it joined and the wait estimated."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING

import grpc.aio
import pytest
import redis.asyncio as aioredis
from prometheus_client import REGISTRY

from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    affinity_pb2,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.errors import decode
from turnstile_platform.server import GrpcService
from turnstile_testing.admission import admission_settings, running_admission
from turnstile_testing.eventually import eventually
from turnstile_testing.substrate import direct_substrate_settings, running_substrate

if TYPE_CHECKING:
    from conftest import Affinity, StartAffinity, StartWorker

TENANT = "acme"
ACME = common_pb2.ActivationClient(client_id=TENANT)


def _wakes(result: str) -> float:
    value = REGISTRY.get_sample_value("turnstile_affinity_wakes_total", {"result": result})
    return value or 0.0


@pytest.fixture
async def admission(redis_url: str, redis_prefix: str) -> AsyncIterator[GrpcService]:
    """Real admission; only the cluster bucket (set by each test) ever refuses."""
    settings = admission_settings(
        redis_url,
        redis_prefix,
        client_allowlist=(TENANT, "other"),
        cap={"default_cap": 10_000, "mode": "off"},
        rate={"default_burst": 10_000, "cluster_burst": 10_000},
        concurrency={"default_limit": 10_000},
        queue={"tick_interval_s": 0.01},
    )
    async with running_admission(settings) as app:
        yield app


@pytest.fixture
async def substrate(
    admission: GrpcService, database_url: str, redis_url: str, redis_prefix: str, tmp_path: Path
) -> AsyncIterator[GrpcService]:
    """Real substrate, Direct runtimes, admitting through the real admission; the
    runtimes a test left running are deactivated after it."""
    settings = direct_substrate_settings(
        database_url,
        redis_url,
        redis_prefix,
        admission.address,
        tmp_path / "direct",
        # The create keeps little of the wake's deadline, so the queue gets it.
        admission_wait_margin_s=1.0,
    )
    async with running_substrate(settings) as app:
        yield app


async def test_a_woken_session_waits_its_turn_on_a_contended_cluster_instead_of_failing(
    affinity: StartAffinity,
    worker: StartWorker,
    admission: GrpcService,
    substrate: GrpcService,
    redis: aioredis.Redis,
    redis_prefix: str,
) -> None:
    async with (
        grpc.aio.insecure_channel(substrate.address) as sub_channel,
        grpc.aio.insecure_channel(admission.address) as adm_channel,
    ):
        sandboxes = substrate_pb2_grpc.SubstrateServiceStub(sub_channel)
        admit = admission_pb2_grpc.AdmissionServiceStub(adm_channel)
        # a1 is acme's (its record is what the wake checks), then stopped.
        await sandboxes.Activate(substrate_pb2.ActivateRequest(sandbox_id="a1", client=ACME))
        await sandboxes.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="a1"))
        service = await affinity(wake_enabled=True, substrate_addr=substrate.address)
        a1 = await worker(service.address, "a1", capacity=4)
        assert (await service.place("chat")).sandbox_id == "a1"
        await a1.stop()

        # The cluster bucket is spent and refills once in 1000 s.
        limits = LimitsStore(redis, redis_prefix)
        await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))
        drain = admission_pb2.AdmitRequest(
            sandbox_id="drain", client=ACME, kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM
        )
        assert (await admit.Admit(drain)).decision == admission_pb2.DECISION_ADMITTED
        refused_before, activated_before = _wakes("refused"), _wakes("activated")

        # The turn is pending; its wake queues in admission with the turn's deadline.
        assert await _refused_reason(service, timeout_s=20) == "SANDBOX_PENDING"

        async def queued() -> bool:
            return int(await redis.hlen(f"{redis_prefix}{{adm}}:q:info")) >= 1

        await eventually(queued, what="the wake's Admit waits in the fair queue")
        assert _wakes("refused") == refused_before  # it waits, it is not refused

        # The bucket refills: the wake is admitted and the sandbox runs again.
        await limits.set_cluster(ClusterLimits(rate=20, burst=1))

        async def woken() -> bool:
            return _wakes("activated") == activated_before + 1

        await eventually(woken, what="the wake activated a1")
        got = await sandboxes.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id="a1"))
        assert got.sandbox.state == substrate_pb2.SANDBOX_STATE_RUNNING
        assert _wakes("refused") == refused_before


async def test_an_activate_that_queued_says_its_position_and_estimated_wait(
    admission: GrpcService, substrate: GrpcService, redis: aioredis.Redis, redis_prefix: str
) -> None:
    limits = LimitsStore(redis, redis_prefix)
    await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))  # one token in 1000 s
    async with grpc.aio.insecure_channel(substrate.address) as channel:
        sandboxes = substrate_pb2_grpc.SubstrateServiceStub(channel)
        first = substrate_pb2.ActivateRequest(sandbox_id="sb-first", client=ACME)
        assert not (await sandboxes.Activate(first)).HasField("waited")
        request = substrate_pb2.ActivateRequest(sandbox_id="sb-queued", client=ACME)
        request.wait_budget.FromSeconds(20)
        activating = asyncio.ensure_future(sandboxes.Activate(request, timeout=40))

        async def queued() -> bool:
            return int(await redis.hlen(f"{redis_prefix}{{adm}}:q:info")) >= 1

        await eventually(queued, what="the Activate's Admit waits in the fair queue")
        await limits.set_cluster(ClusterLimits(rate=20, burst=1))
        response = await activating
    assert response.outcome == substrate_pb2.OUTCOME_CREATED
    assert response.waited.ToMilliseconds() > 0
    assert response.queue_position == 1
    # Alone in the queue at one token in 1000 s when it joined.
    assert response.estimated_wait.ToMilliseconds() == 1_000_000


async def _refused_reason(service: Affinity, timeout_s: float) -> str:
    """The reason the turn's Place, with a deadline of ``timeout_s``, is refused."""
    request = affinity_pb2.PlaceRequest(session_id="chat", client_id=TENANT)
    try:
        await service.stub.Place(request, timeout=timeout_s)
    except grpc.aio.AioRpcError as error:
        return decode(error).reason
    raise AssertionError("the turn was placed, not pending")
