"""A peer channel follows its certificate files (SPEC Z4): after the files change, the
next calls go out on a new channel with the new certificate; calls never fail."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform import peers
from turnstile_platform.identity import peer_identity
from turnstile_platform.server import GrpcService
from turnstile_testing.pki import Pki
from turnstile_testing.probe import settings

USAGE = "GetUsage"
POLICY = """
[[allow]]
identities = ["spiffe://turnstile.test/service/*"]
methods = ["turnstile.admission.v1.AdmissionService/GetUsage"]
clients = "any"
"""


async def _who(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    """GetUsage that answers with the caller's identity as the key."""
    key = common_pb2.BoundedKey(key=peer_identity(context) or "")
    return admission_pb2.GetUsageResponse(key=key).SerializeToString()


async def test_a_peer_presents_the_new_certificate_after_rotation(
    pki: Pki, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(peers, "ROTATION_CHECK_S", 0.0)
    server = GrpcService(
        "probe",
        settings(**pki.server_settings("service/admission", policy=POLICY)),
        service_names=[],
    )
    handler = grpc.unary_unary_rpc_method_handler(_who)
    server.server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(peers.ADMISSION, {USAGE: handler}),)
    )
    await server.start()
    first = pki.identity("service/substrate", name="me")
    peer = peers.admission(settings(**first.settings(), **pki.peer_ids()), target=server.address)
    request = admission_pb2.GetUsageRequest(client=common_pb2.ActivationClient(client_id="a"))
    try:
        before = await peer.stub.GetUsage(request)
        assert before.key.key == "spiffe://turnstile.test/service/substrate"
        pki.identity("service/renamed", name="me")  # the same files, a new certificate
        after = await peer.stub.GetUsage(request)
        assert after.key.key == "spiffe://turnstile.test/service/renamed"
        assert (await peer.stub.GetUsage(request)).key.key == after.key.key
    finally:
        await peer.close()
        await server.stop()
