"""Authorization of every substrate RPC over mTLS (SPEC Z1, Z2): allowed → served,
another identity → PERMISSION_DENIED, no identity → UNAUTHENTICATED, PostgreSQL and
the runtimes unchanged after each refusal; sandbox-addressed calls and ``inherit``
act for the sandbox's recorded client."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

import asyncpg
import grpc
import grpc.aio
import pytest

from turnstile_contracts import admission_pb2_grpc, common_pb2, substrate_pb2
from turnstile_platform import tls
from turnstile_testing.authz import (
    Invoke,
    authorized,
    outcome,
    postgres_snapshot,
    refusal,
    unary,
)
from turnstile_testing.pki import Pki

if TYPE_CHECKING:
    from conftest import AdmissionDouble, Harness, StartService

SERVICE = "turnstile.substrate.v1.SubstrateService"
TD = "spiffe://turnstile.test"

POLICY = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/service/affinity"]
methods = ["{SERVICE}/*"]
clients = "any"

[[allow]]
identities = ["{TD}/client/*"]
methods = [
  "{SERVICE}/Activate", "{SERVICE}/Deactivate", "{SERVICE}/GetSandbox",
  "{SERVICE}/ListSandboxes",
]
clients = "self"

[[allow]]
identities = ["{TD}/service/admission"]
methods = ["{SERVICE}/CountLiveSandboxes"]
"""


def _client(client_id: str) -> common_pb2.ActivationClient:
    return common_pb2.ActivationClient(client_id=client_id)


INHERIT = common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())


def _call(method: str, request: Any) -> Invoke:
    return unary(f"/{SERVICE}/{method}", request)


CALLS: dict[str, Invoke] = {
    "Activate": _call(
        "Activate", substrate_pb2.ActivateRequest(sandbox_id="sb-new", client=_client("acme"))
    ),
    "Deactivate": _call("Deactivate", substrate_pb2.DeactivateRequest(sandbox_id="sb-acme")),
    "CountLiveSandboxes": _call(
        "CountLiveSandboxes", substrate_pb2.CountLiveSandboxesRequest(key="acme")
    ),
    "GetSandbox": _call("GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id="sb-acme")),
    "ListSandboxes": _call("ListSandboxes", substrate_pb2.ListSandboxesRequest(client_id="acme")),
}


def test_the_table_covers_every_method() -> None:
    descriptor = substrate_pb2.DESCRIPTOR.services_by_name["SubstrateService"]
    assert set(CALLS) == {m.name for m in descriptor.methods}


@pytest.fixture
async def tls_admission(admission: AdmissionDouble, pki: Pki) -> AsyncIterator[str]:
    """The same admission double, on an mTLS port (the substrate calls it over mTLS)."""
    me = pki.identity("service/admission", server=True)
    server = grpc.aio.server()
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(admission, server)
    files = tls.TlsFiles(me.cert_file, me.key_file, me.ca_file)
    port = server.add_secure_port("127.0.0.1:0", tls.server_credentials(files))
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(None)


@pytest.fixture
async def secured(
    migrated_url: str, start_service: StartService, tls_admission: str, pki: Pki
) -> Harness:
    conn = await asyncpg.connect(migrated_url)
    try:
        await conn.executemany(
            "INSERT INTO sandboxes (id, state, substrate, activating_client_id)"
            " VALUES ($1, 'stopped', 'direct', $2)",
            [("sb-acme", "acme"), ("sb-globex", "globex"), ("sb-nobody", None)],
        )
    finally:
        await conn.close()
    worker = pki.identity("sandbox")
    return await start_service(
        migrated_url,
        admission_addr=tls_admission,
        direct_worker_tls_cert_file=worker.cert_file,
        direct_worker_tls_key_file=worker.key_file,
        **pki.server_settings("service/substrate", policy=POLICY),
    )


@pytest.mark.parametrize("method", sorted(CALLS))
async def test_every_rpc_serves_the_allowed_and_refuses_the_rest_changing_nothing(
    method: str, secured: Harness, pki: Pki
) -> None:
    address = secured.app.address
    invoke = CALLS[method]
    before = await postgres_snapshot(secured.database_url)
    async with pki.identity("sandbox").channel(address) as other:
        code, reason, metadata = await refusal(other, invoke)
        assert (code, reason) == (grpc.StatusCode.PERMISSION_DENIED, "PERMISSION_DENIED")
        assert metadata == {"identity": f"{TD}/sandbox", "method": f"{SERVICE}/{method}"}
    async with pki.identity(None).channel(address) as anonymous:
        code, reason, _ = await refusal(anonymous, invoke)
        assert (code, reason) == (grpc.StatusCode.UNAUTHENTICATED, "UNAUTHENTICATED")
    assert await postgres_snapshot(secured.database_url) == before
    assert secured.processes() == {}
    async with pki.identity("service/affinity").channel(address) as allowed:
        assert await authorized(allowed, invoke)


async def test_a_client_acts_only_for_its_own_sandboxes(secured: Harness, pki: Pki) -> None:
    address = secured.app.address
    async with pki.identity("client/acme").channel(address) as acme:
        before = await postgres_snapshot(secured.database_url)
        for method, request in (
            (
                "Activate",
                substrate_pb2.ActivateRequest(sandbox_id="sb-x", client=_client("globex")),
            ),
            ("Activate", substrate_pb2.ActivateRequest(sandbox_id="sb-globex", client=INHERIT)),
            ("Activate", substrate_pb2.ActivateRequest(sandbox_id="sb-nobody", client=INHERIT)),
            ("Deactivate", substrate_pb2.DeactivateRequest(sandbox_id="sb-globex")),
            ("GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id="sb-globex")),
            ("GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id="sb-unknown")),
            ("ListSandboxes", substrate_pb2.ListSandboxesRequest(client_id="globex")),
            ("ListSandboxes", substrate_pb2.ListSandboxesRequest()),
            ("CountLiveSandboxes", substrate_pb2.CountLiveSandboxesRequest(key="acme")),
        ):
            code, _, metadata = await refusal(acme, _call(method, request))
            assert code == grpc.StatusCode.PERMISSION_DENIED, (method, request)
            assert metadata["identity"] == f"{TD}/client/acme"
        assert await postgres_snapshot(secured.database_url) == before
        assert secured.processes() == {}

        got = await acme.unary_unary(
            f"/{SERVICE}/GetSandbox",
            request_serializer=substrate_pb2.GetSandboxRequest.SerializeToString,
            response_deserializer=substrate_pb2.GetSandboxResponse.FromString,
        )(substrate_pb2.GetSandboxRequest(sandbox_id="sb-acme"))
        assert got.sandbox.activating_client_id == "acme"
        listed = _call("ListSandboxes", substrate_pb2.ListSandboxesRequest(client_id="acme"))
        assert await outcome(acme, listed) == grpc.StatusCode.OK
        # Waking its own sandbox with ``inherit`` is served: a runtime starts.
        woken = _call(
            "Activate", substrate_pb2.ActivateRequest(sandbox_id="sb-acme", client=INHERIT)
        )
        assert await outcome(acme, woken) == grpc.StatusCode.OK
        assert set(secured.processes()) == {"sb-acme"}


async def test_plaintext_and_another_ca_are_refused(secured: Harness, pki: Pki) -> None:
    invoke = CALLS["CountLiveSandboxes"]
    async with grpc.aio.insecure_channel(secured.app.address) as plaintext:
        assert await outcome(plaintext, invoke) == grpc.StatusCode.UNAVAILABLE
    stranger = Pki(pki.directory / "stranger").identity("service/affinity")
    async with stranger.channel(secured.app.address) as channel:
        assert await outcome(channel, invoke) == grpc.StatusCode.UNAVAILABLE
