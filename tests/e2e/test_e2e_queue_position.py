"""An Activate's live place in admission's fair queue (SPEC Q1), end to end: the real
substrate on the API-server emulator and the real admission service over real sockets.

The cluster bucket is shut (one token, spent, refilling every 1,000 s), so a cold create
that asks to wait waits in the fair queue. The substrate passes its ``wait_id`` and its
wait budget — the request's, bounded by the caller's deadline less
``TURNSTILE_ADMISSION_WAIT_MARGIN_S`` — down to Admit: the caller, asking admission's
``GetQueuePosition`` under the same client, finds the call waiting at the head. Opened,
the bucket lets the Activate make its pod; a caller whose deadline comes first is refused
before it, or gives up, and nothing of its wait is left.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import asyncpg
import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from google.protobuf.duration_pb2 import Duration

from turnstile_admission.keys import AdmissionKeys
from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.errors import decode
from turnstile_substrate.runtime import LABEL_CLIENT_ID, LABEL_SANDBOX_ID
from turnstile_testing.eventually import eventually
from turnstile_testing.kube_emulator import KubeEmulator

from .kube_stack import API_ONLY, NAMESPACE, activate_for_acme, kube_services

ACME = common_pb2.ActivationClient(client_id="acme")
#: What the substrate keeps back from a waiting Activate's deadline for the create.
MARGIN_S = 1.0
#: One token, refilling every 1,000 s: once spent, the bucket stays empty for the test.
SHUT = ClusterLimits(rate=0.001, burst=1)
OPEN = ClusterLimits(rate=50, burst=1)
#: Far more than any caller's deadline here: the deadline bounds the wait.
BUDGET = Duration(seconds=30)


@dataclass
class Stack:
    kube: KubeEmulator
    substrate: substrate_pb2_grpc.SubstrateServiceAsyncStub
    admission: admission_pb2_grpc.AdmissionServiceAsyncStub
    limits: LimitsStore
    keys: AdmissionKeys
    redis: aioredis.Redis
    database_url: str

    def activate(self, sandbox_id: str, wait_id: str, deadline_s: float) -> asyncio.Future[object]:
        """A cold create that asks to wait (the budget far past ``deadline_s``)."""
        request = substrate_pb2.ActivateRequest(
            sandbox_id=sandbox_id, client=ACME, wait_budget=BUDGET, wait_id=wait_id
        )
        return asyncio.ensure_future(self.substrate.Activate(request, timeout=deadline_s))

    async def position(self, wait_id: str) -> admission_pb2.GetQueuePositionResponse:
        """Where the wait stands, asked as its caller asks: the same client, its wait_id."""
        request = admission_pb2.GetQueuePositionRequest(client=ACME, wait_id=wait_id)
        return await self.admission.GetQueuePosition(request)

    async def waiting_at_head(self, wait_id: str, call: asyncio.Future[object]) -> None:
        """Until ``wait_id`` waits at position 1; fails at once if the call ended first
        (answered without waiting: the wait_id or the budget was not passed down)."""

        async def at_head() -> bool:
            if call.done():
                raise AssertionError(f"the Activate ended before it was seen waiting: {call!r}")
            found = await self.position(wait_id)
            return bool(found.state == admission_pb2.QUEUE_STATE_WAITING and found.position == 1)

        await eventually(at_head, timeout_s=5, what=f"{wait_id} waiting at the head")

    def pods_of(self, sandbox_id: str) -> list[dict[str, object]]:
        return [
            p
            for p in self.kube.pods(NAMESPACE)
            if (p["metadata"].get("labels") or {}).get(LABEL_SANDBOX_ID) == sandbox_id
        ]

    async def left_behind(self, sandbox_id: str, wait_id: str) -> list[str]:
        """What a wait that ended without a runtime left: nothing, or what it is."""
        left = []
        if (await self.position(wait_id)).state != admission_pb2.QUEUE_STATE_NOT_FOUND:
            left.append("its GetQueuePosition entry")
        if await self.redis.hlen(self.keys.queue_info):
            left.append(f"q:info {await self.redis.hgetall(self.keys.queue_info)}")
        holds = [k async for k in self.redis.scan_iter(match=self.keys.hold("*"))]
        if holds:
            left.append(f"holds {holds}")
        if await self.redis.zscore(self.keys.pending("acme"), sandbox_id) is not None:
            left.append("a pending entry")
        if await self.redis.zcard(self.keys.inflight("acme")):
            left.append("a concurrency lease")
        if self.pods_of(sandbox_id):
            left.append("a pod")
        conn = await asyncpg.connect(self.database_url)
        try:
            claims = await conn.fetchval(
                "SELECT count(*) FROM activation_claims WHERE sandbox_id = $1", sandbox_id
            )
            recorded = await conn.fetchval(
                "SELECT count(*) FROM sandboxes WHERE id = $1", sandbox_id
            )
        finally:
            await conn.close()
        if claims:
            left.append("an activation claim")
        if recorded:
            left.append("a sandbox record")
        return left


@pytest.fixture
async def stack(
    redis_url: str,
    redis_prefix: str,
    redis: aioredis.Redis,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Stack]:
    """Substrate and admission with the cluster bucket shut: its one token spent by a
    first Activate (a pod made), nothing refilled for the rest of the test. The
    client's own limits are out of the way, so only the cluster bucket refuses."""
    async with (
        kube_services(
            redis_url,
            redis_prefix,
            database_url,
            monkeypatch,
            cluster=API_ONLY,
            substrate={"admission_wait_margin_s": MARGIN_S},
            admission={
                "rate": {"default_rate_per_s": 1000, "default_burst": 1000},
                "cap": {"default_cap": 100},
                "concurrency": {"default_limit": 100},
                "queue": {"tick_interval_s": 0.01},
            },
        ) as services,
        grpc.aio.insecure_channel(services.substrates[0].address) as sub,
        grpc.aio.insecure_channel(services.admission.address) as adm,
    ):
        limits = LimitsStore(redis, redis_prefix)
        await limits.set_cluster(SHUT)
        substrate = substrate_pb2_grpc.SubstrateServiceStub(sub)
        first = await activate_for_acme(substrate, "sb-first")
        assert isinstance(first, substrate_pb2.ActivateResponse), str(first)
        assert first.key.key == "acme"
        yield Stack(
            services.kube,
            substrate,
            admission_pb2_grpc.AdmissionServiceStub(adm),
            limits,
            AdmissionKeys(redis_prefix),
            redis,
            database_url,
        )


async def test_a_waiting_activate_is_found_at_the_head_by_its_wait_id_until_it_runs(
    stack: Stack,
) -> None:
    call = stack.activate("sb-waits", "wait-1", deadline_s=8)
    await stack.waiting_at_head("wait-1", call)
    found = await stack.position("wait-1")
    assert found.key_waiters == 1
    assert found.HasField("estimated_wait")

    await stack.limits.set_cluster(OPEN)
    response = await call
    assert isinstance(response, substrate_pb2.ActivateResponse)
    assert response.outcome == substrate_pb2.OUTCOME_CREATED
    assert response.charged_client_id == "acme"
    assert response.HasField("waited")
    assert response.queue_position == 1
    [pod] = stack.pods_of("sb-waits")
    assert pod["metadata"]["labels"][LABEL_CLIENT_ID] == "acme"  # type: ignore[index]
    # Answered: the entry is gone (granted and claimed).
    assert (await stack.position("wait-1")).state == admission_pb2.QUEUE_STATE_NOT_FOUND


async def test_a_deadline_ending_while_the_activate_waits_refuses_it_first_and_leaves_nothing(
    stack: Stack,
) -> None:
    """The budget passed down is the deadline less the margin, not the 30 s asked: the
    wait ends, RESOURCE_EXHAUSTED / RATE_LIMITED, a margin before the caller's deadline."""
    deadline_s = 3.0
    loop = asyncio.get_running_loop()
    started = loop.time()
    call = stack.activate("sb-late", "wait-2", deadline_s=deadline_s)
    await stack.waiting_at_head("wait-2", call)
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    elapsed = loop.time() - started
    refused = decode(raised.value)
    assert refused.code == grpc.StatusCode.RESOURCE_EXHAUSTED, str(refused)
    assert refused.reason == "RATE_LIMITED"
    assert deadline_s - MARGIN_S - 0.3 <= elapsed < deadline_s, elapsed
    assert await stack.left_behind("sb-late", "wait-2") == []


async def test_a_caller_giving_up_while_the_activate_waits_leaves_nothing(stack: Stack) -> None:
    """X6: the caller cancels mid-wait; the substrate's Admit is cancelled with it, and
    admission's entry, the claim and everything else go."""
    call = stack.activate("sb-gone", "wait-3", deadline_s=8)
    await stack.waiting_at_head("wait-3", call)
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call

    left: list[str] = []

    async def nothing_left() -> bool:
        left[:] = await stack.left_behind("sb-gone", "wait-3")
        return not left

    try:
        await eventually(nothing_left, timeout_s=5, what="nothing left of the wait")
    except AssertionError as error:
        raise AssertionError(f"left behind: {left}") from error
