"""Authorization of every affinity RPC over mTLS (SPEC Z1, Z2): allowed → served, another
identity → PERMISSION_DENIED, no identity → UNAUTHENTICATED, Redis unchanged after each
refusal. Sandbox runtimes hold one shared class identity that may call ``Attach`` and
nothing else; a worker agent attaches with it."""

from __future__ import annotations

from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_affinity.worker.agent import _relay_channel
from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_contracts import affinity_pb2
from turnstile_testing.authz import (
    Invoke,
    authorized,
    outcome,
    redis_snapshot,
    refusal,
    stream,
    unary,
)
from turnstile_testing.pki import Pki

SERVICE = "turnstile.affinity.v1.AffinityService"
TD = "spiffe://turnstile.test"

POLICY = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/service/gateway"]
methods = [
  "{SERVICE}/Place", "{SERVICE}/ReleaseLease", "{SERVICE}/GetSession", "{SERVICE}/ListWorkers",
  "{SERVICE}/Prepare",
]
clients = "any"

# A tenant's own gateway: its own sessions and sandboxes only (SPEC O2).
[[allow]]
identities = ["{TD}/client/*"]
methods = [
  "{SERVICE}/Place", "{SERVICE}/ReleaseLease", "{SERVICE}/GetSession", "{SERVICE}/ListWorkers",
  "{SERVICE}/Prepare",
]
clients = "self"

[[allow]]
identities = ["{TD}/sandbox"]
methods = ["{SERVICE}/Attach"]
"""

HELLO = affinity_pb2.AttachRequest(hello=affinity_pb2.Hello(sandbox_id="sb-1", capacity=1))

CALLS: dict[str, Invoke] = {
    "Place": unary(
        f"/{SERVICE}/Place", affinity_pb2.PlaceRequest(client_id="acme", session_id="s-1")
    ),
    "ReleaseLease": unary(
        f"/{SERVICE}/ReleaseLease",
        affinity_pb2.ReleaseLeaseRequest(sandbox_id="sb-1", lease_id="l-1"),
    ),
    "Attach": stream(f"/{SERVICE}/Attach", [HELLO]),
    "GetSession": unary(
        f"/{SERVICE}/GetSession", affinity_pb2.GetSessionRequest(client_id="acme", session_id="s")
    ),
    "ListWorkers": unary(f"/{SERVICE}/ListWorkers", affinity_pb2.ListWorkersRequest()),
    "Prepare": unary(
        f"/{SERVICE}/Prepare", affinity_pb2.PrepareRequest(client_id="acme", session_id="s")
    ),
}
ALLOWED = {name: "sandbox" if name == "Attach" else "service/gateway" for name in CALLS}
OTHER = {name: "service/gateway" if name == "Attach" else "sandbox" for name in CALLS}


def test_the_table_covers_every_method() -> None:
    descriptor = affinity_pb2.DESCRIPTOR.services_by_name["AffinityService"]
    assert set(CALLS) == {m.name for m in descriptor.methods}


@pytest.fixture
async def secured(affinity: Any, pki: Pki) -> Any:
    return await affinity(**pki.server_settings("service/affinity", policy=POLICY))


@pytest.mark.parametrize("method", sorted(CALLS))
async def test_every_rpc_serves_the_allowed_and_refuses_the_rest_changing_nothing(
    method: str, secured: Any, pki: Pki, redis: aioredis.Redis
) -> None:
    invoke = CALLS[method]
    before = await redis_snapshot(redis, secured.settings.redis_prefix)
    async with pki.identity(OTHER[method]).channel(secured.address) as other:
        code, reason, metadata = await refusal(other, invoke)
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
        assert metadata == {"identity": f"{TD}/{OTHER[method]}", "method": f"{SERVICE}/{method}"}
    async with pki.identity(None).channel(secured.address) as anonymous:
        code, reason, _ = await refusal(anonymous, invoke)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert await redis_snapshot(redis, secured.settings.redis_prefix) == before
    async with pki.identity(ALLOWED[method]).channel(secured.address) as allowed:
        assert await authorized(allowed, invoke)


@pytest.mark.parametrize(
    "call",
    [
        unary(f"/{SERVICE}/Place", affinity_pb2.PlaceRequest(client_id="globex", session_id="s")),
        unary(
            f"/{SERVICE}/GetSession",
            affinity_pb2.GetSessionRequest(client_id="globex", session_id="s"),
        ),
        unary(
            f"/{SERVICE}/ReleaseLease",
            affinity_pb2.ReleaseLeaseRequest(sandbox_id="sb-1", lease_id="0" * 32),
        ),
        unary(f"/{SERVICE}/ListWorkers", affinity_pb2.ListWorkersRequest()),
        unary(f"/{SERVICE}/ListWorkers", affinity_pb2.ListWorkersRequest(client_id="globex")),
        unary(
            f"/{SERVICE}/Prepare", affinity_pb2.PrepareRequest(client_id="globex", session_id="s")
        ),
    ],
    ids=["place-other", "get-other", "release-anyone", "list-all", "list-other", "prepare-other"],
)
async def test_a_tenant_scoped_to_self_acts_only_for_itself(
    call: Invoke, secured: Any, pki: Pki, redis: aioredis.Redis
) -> None:
    """SPEC O2: Place, GetSession, ReleaseLease, ListWorkers and Prepare act for a client, and
    an identity scoped ``self`` acts for its own client id only (none: only ``any``)."""
    before = await redis_snapshot(redis, secured.settings.redis_prefix)
    async with pki.identity("client/acme").channel(secured.address) as acme:
        code, reason, _ = await refusal(acme, call)
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
        own = unary(f"/{SERVICE}/ListWorkers", affinity_pb2.ListWorkersRequest(client_id="acme"))
        assert await authorized(acme, own)
    assert await redis_snapshot(redis, secured.settings.redis_prefix) == before


async def test_a_worker_attaches_with_the_sandbox_class_certificate(
    secured: Any, worker: Any, pki: Pki
) -> None:
    sandbox = pki.identity("sandbox")
    attached = await worker(
        secured.address,
        "sb-tls",
        plaintext=False,
        tls_cert_file=sandbox.cert_file,
        tls_key_file=sandbox.key_file,
        tls_ca_file=sandbox.ca_file,
        affinity_spiffe_id=pki.spiffe("service/affinity"),
    )
    assert attached.sandbox_id == "sb-tls"
    async with pki.identity("service/gateway").channel(secured.address) as gateway:
        listed = await gateway.unary_unary(
            f"/{SERVICE}/ListWorkers",
            request_serializer=affinity_pb2.ListWorkersRequest.SerializeToString,
            response_deserializer=affinity_pb2.ListWorkersResponse.FromString,
        )(affinity_pb2.ListWorkersRequest())
    assert [w.sandbox_id for w in listed.workers] == ["sb-tls"]


async def test_a_worker_talks_only_to_a_relay_holding_the_expected_identity(
    secured: Any, pki: Pki
) -> None:
    """The worker's channel checks the relay's SPIFFE ID (SPEC O5): expecting another
    identity (as a runtime posing as the relay on a port the worker dials would hold),
    the handshake fails; expecting affinity's, health answers."""
    sandbox = pki.identity("sandbox")

    async def health(expected: str) -> str:
        worker = WorkerSettings(
            sandbox_id="sb-x",
            affinity_addr=secured.address,
            plaintext=False,
            tls_cert_file=sandbox.cert_file,
            tls_key_file=sandbox.key_file,
            tls_ca_file=sandbox.ca_file,
            affinity_spiffe_id=expected,
        )
        async with _relay_channel(worker) as channel:
            try:
                answer = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=5
                )
            except grpc.aio.AioRpcError as error:
                return f"{error.code().name}: {error.details()}"
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(answer.status))

    assert await health(pki.spiffe("service/affinity")) == "SERVING"
    refused = await health(pki.spiffe("service/substrate"))
    assert refused.startswith("UNAVAILABLE")
    assert "Hostname Verification Check failed" in refused


async def test_plaintext_and_another_ca_are_refused(secured: Any, pki: Pki) -> None:
    async with grpc.aio.insecure_channel(secured.address) as plaintext:
        assert await outcome(plaintext, CALLS["ListWorkers"]) == grpc.StatusCode.UNAVAILABLE
    stranger = Pki(pki.directory / "stranger").identity("service/gateway")
    async with stranger.channel(secured.address) as channel:
        assert await outcome(channel, CALLS["ListWorkers"]) == grpc.StatusCode.UNAVAILABLE
