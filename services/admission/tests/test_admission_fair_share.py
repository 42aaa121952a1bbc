"""One tenant's flood of calls takes only its own flow's share of a replica (SPEC N1),
through the real admission server over mutual TLS with tenant certificates.

acme sends more concurrent ``Admit`` calls than the replica serves at once, each
waiting in admission's fair queue for a cluster bucket that has no token, so each
holds its call seat. Its excess is refused ``RESOURCE_EXHAUSTED`` naming its flow
and level; meanwhile globex (another tenant) and the substrate (the platform) are
served every call. Counts and refusals are asserted, never times."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio

from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_platform.call_limits import CallKind
from turnstile_platform.errors import decode
from turnstile_platform.fair_share import Level
from turnstile_testing.eventually import eventually
from turnstile_testing.pki import Pki

SERVICE = "turnstile.admission.v1.AdmissionService"
TD = "spiffe://turnstile.test"

POLICY = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/service/substrate"]
methods = ["{SERVICE}/*"]
clients = "any"

[[allow]]
identities = ["{TD}/client/*"]
methods = ["{SERVICE}/Admit", "{SERVICE}/GetUsage"]
clients = "self"
"""

#: The replica's unary calls at once: tenants are assured ceil(8 × 40%) = 4.
TOTAL = 8
QUEUE = 2
FLOOD = 20


def _client(client_id: str) -> common_pb2.ActivationClient:
    return common_pb2.ActivationClient(client_id=client_id)


def _admit(client_id: str, sandbox_id: str, wait_s: int = 0) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=_client(client_id),
        kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
    )
    if wait_s:
        request.wait_budget.FromSeconds(wait_s)
    return request


async def _served(stub: Any, client_id: str, calls: int) -> int:
    """``calls`` GetUsage of ``client_id``, one after another: how many were served."""
    served = 0
    for _ in range(calls):
        await stub.GetUsage(admission_pb2.GetUsageRequest(client=_client(client_id)), timeout=30)
        served += 1
    return served


async def test_a_tenants_flood_is_refused_in_its_own_flow_while_another_tenant_and_the_platform_are_served(  # noqa: E501
    start_admission: Any, pki: Pki
) -> None:
    admission = await start_admission(
        client_allowlist=("acme", "globex"),
        rate={"cluster_rate_per_s": 0.001, "cluster_burst": 1},
        queue={"tick_interval_s": 0.05},
        max_concurrent_rpcs=TOTAL,
        fair_share={"queue_length": QUEUE, "queue_wait_s": 60},
        **pki.server_settings("service/admission", policy=POLICY),
    )
    address = admission.app.address
    async with (
        pki.identity("client/acme").channel(address) as acme_channel,
        pki.identity("client/globex").channel(address) as globex_channel,
        pki.identity("service/substrate").channel(address) as substrate_channel,
    ):
        acme: Any = admission_pb2_grpc.AdmissionServiceStub(acme_channel)
        globex: Any = admission_pb2_grpc.AdmissionServiceStub(globex_channel)
        substrate: Any = admission_pb2_grpc.AdmissionServiceStub(substrate_channel)
        await substrate.Admit(_admit("globex", "globex--first"))  # the bucket's one token
        flood = [
            asyncio.ensure_future(acme.Admit(_admit("acme", f"acme--sb-{n}", 50), timeout=60))
            for n in range(FLOOD)
        ]
        try:
            # Every seat the replica has, held by acme's waits; two more wait for
            # a seat in acme's own queue; the rest are refused at once.
            await eventually(
                lambda: sum(call.done() for call in flood) >= FLOOD - TOTAL - QUEUE,
                what="acme's excess refused",
            )
            # Another tenant (its fair share: 2 of the tenants' 4, two at a time)
            # and the platform (3 assured, three at a time) are served every call.
            victims = await asyncio.gather(
                *(_served(globex, "globex", 10) for _ in range(2)),
                *(_served(substrate, "acme", 10) for _ in range(3)),
            )
            assert victims == [10] * 5
            refused = [call.exception() for call in flood if call.done()]
            assert len(refused) == FLOOD - TOTAL - QUEUE
            for error in refused:
                assert isinstance(error, grpc.aio.AioRpcError)
                assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                rich = decode(error)
                assert rich.reason == "CONCURRENCY_LIMITED"
                assert rich.retry_after_s is not None
                assert rich.metadata["flow"] == f"{TD}/client/acme for acme"
                assert rich.metadata["level"] == "tenants"
                assert rich.metadata["why"] == "queue_full"
            seats = admission.app.limits.seats[CallKind.UNARY]
            assert seats.level_in_flight(Level.TENANTS) == TOTAL
            assert seats.waiting == QUEUE
        finally:
            for call in flood:
                call.cancel()
        # acme's waiting calls, cancelled, leave its queue; its seats come back.
        seats = admission.app.limits.seats[CallKind.UNARY]
        await eventually(
            lambda: seats.waiting == 0 and seats.in_flight == 0, what="the flood's seats freed"
        )
