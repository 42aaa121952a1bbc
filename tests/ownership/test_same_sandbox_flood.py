"""One tenant flooding Activates of one of its own sandboxes takes no other tenant's
call slots (SPEC N2), over mutual TLS with tenant certificates through the real
substrate and admission.

acme's limit is full, so its first Activate of ``acme--two`` waits in admission's fair
queue (``wait_budget`` with ``queue_per_client``) as that sandbox's activation. acme
then sends many more of the same: before, each waited on the sandbox's in-process
lock and together they held every unary call slot of the replica, so globex's
Activate was refused ``RESOURCE_EXHAUSTED``. Now a few join the activation in
progress and the rest are refused at once (``ABORTED``, ``SANDBOX_PENDING``)."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf.duration_pb2 import Duration

from turnstile_clientkeys.limits import LimitsStore
from turnstile_contracts import admission_pb2, substrate_pb2
from turnstile_platform.errors import RichError, decode

from .conftest import ADMISSION, SUBSTRATE, Tenants, client

#: The substrate's unary call slots, and acme's flood: more than the slots.
UNARY_SLOTS = 24
FLOOD = 60
#: acme's calls that may join the activation in progress (the setting's default).
JOINERS = 8


@pytest.fixture
def substrate_overrides() -> dict[str, Any]:
    return {"max_concurrent_rpcs": UNARY_SLOTS, "activation_waiters_per_flow": JOINERS}


def waiting_activate(wait_id: str = "") -> substrate_pb2.ActivateRequest:
    return substrate_pb2.ActivateRequest(
        sandbox_id="acme--two",
        client=client("acme"),
        wait_budget=Duration(seconds=60),
        queue_per_client=True,
        wait_id=wait_id,
    )


async def answer(call: Any) -> object:
    try:
        result: object = await call
    except grpc.aio.AioRpcError as error:
        return decode(error)
    return result


def activate_as(tenants: Tenants, who: str, request: substrate_pb2.ActivateRequest) -> Any:
    channel = tenants.channels[f"{who}@{tenants.substrate.address}"]
    rpc = channel.unary_unary(
        f"/{SUBSTRATE}/Activate",
        request_serializer=substrate_pb2.ActivateRequest.SerializeToString,
        response_deserializer=substrate_pb2.ActivateResponse.FromString,
    )
    return rpc(request, timeout=90)


async def queued(tenants: Tenants, wait_id: str, leader: asyncio.Task[object]) -> None:
    """Until acme's ``wait_id`` waits in admission's queue (fails if it was answered)."""
    request = admission_pb2.GetQueuePositionRequest(client=client("acme"), wait_id=wait_id)
    async with asyncio.timeout(20):
        while True:
            assert not leader.done(), await leader
            found = await tenants.call("acme", ADMISSION, "GetQueuePosition", request)
            if found.state == admission_pb2.QUEUE_STATE_WAITING:
                return
            await asyncio.sleep(0.02)


async def until_done(calls: list[asyncio.Task[object]], count: int) -> list[object]:
    """Until at least ``count`` of ``calls`` are answered; their answers."""
    async with asyncio.timeout(30):
        while sum(c.done() for c in calls) < count:
            await asyncio.wait([c for c in calls if not c.done()], return_when="FIRST_COMPLETED")
    return [c.result() for c in calls if c.done()]


async def test_a_same_sandbox_flood_leaves_another_tenant_served_and_refuses_the_excess(
    tenants: Tenants,
) -> None:
    # acme may have no activation in flight (the Direct substrate counts no live
    # sandboxes for a cap): its next Activate waits in admission's queue.
    await LimitsStore(tenants.redis, tenants.redis_prefix).put("key:acme", {"concurrency": 0})
    leader = asyncio.ensure_future(
        answer(activate_as(tenants, "acme", waiting_activate("flood-leader")))
    )
    flood: list[asyncio.Task[object]] = []
    try:
        await queued(tenants, "flood-leader", leader)
        flood = [
            asyncio.ensure_future(answer(activate_as(tenants, "acme", waiting_activate())))
            for _ in range(FLOOD)
        ]
        # By then every call of the flood has reached the substrate: those past its
        # slots were refused only once the slots were all taken.
        await until_done(flood, FLOOD - UNARY_SLOTS)

        served = await answer(
            activate_as(
                tenants,
                "globex",
                substrate_pb2.ActivateRequest(sandbox_id="globex--a", client=client("globex")),
            )
        )
        assert isinstance(served, substrate_pb2.ActivateResponse), served
        assert served.outcome == substrate_pb2.OUTCOME_CREATED

        refused = await until_done(flood, FLOOD - JOINERS)
        assert not leader.done()  # all of them answered while the activation still waits
        assert len(refused) == FLOOD - JOINERS
        for refusal in refused:
            assert isinstance(refusal, RichError), refusal
            assert (refusal.code, refusal.reason) == (grpc.StatusCode.ABORTED, "SANDBOX_PENDING")
            assert refusal.metadata["why"] == "flow_full"
            assert refusal.retry_after_s is not None

        # Another tenant does not join (nor learn of) acme's activation in progress.
        foreign = await answer(
            activate_as(
                tenants,
                "globex",
                substrate_pb2.ActivateRequest(sandbox_id="acme--two", client=client("globex")),
            )
        )
        assert isinstance(foreign, RichError), foreign
        assert foreign.code == grpc.StatusCode.PERMISSION_DENIED
    finally:
        for call in [leader, *flood]:
            call.cancel()
        await asyncio.gather(leader, *flood, return_exceptions=True)
