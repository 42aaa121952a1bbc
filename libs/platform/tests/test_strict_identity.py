"""Strict identity over real mTLS (SPEC O5): the caller's SPIFFE ID comes from its
certificate's URI SANs only, exactly one; every client checks the server's SPIFFE
ID; only service certificates may serve; the local PKI gives each role only the
usages and names it needs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from cryptography import x509
from cryptography.x509.oid import ExtendedKeyUsageOID

from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform import peers
from turnstile_platform.errors import decode
from turnstile_platform.identity import peer_identity, server_name
from turnstile_platform.pki import ensure_local_pki
from turnstile_platform.server import GrpcService
from turnstile_testing.pki import Pki
from turnstile_testing.probe import add_probe, call, settings

TD = "spiffe://turnstile.test"
POLICY = """
[[allow]]
identities = ["*"]
methods = ["*"]
clients = "any"
"""


async def _who(_: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    """The caller's identity as the server reads it."""
    return (peer_identity(context) or "").encode()


async def _usage(request: bytes, context: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    """GetUsage that answers with the caller's identity as the key."""
    key = common_pb2.BoundedKey(key=peer_identity(context) or "")
    return admission_pb2.GetUsageResponse(key=key).SerializeToString()


async def _probe(pki: Pki, **overrides: Any) -> GrpcService:
    app = GrpcService("probe", settings(**overrides), service_names=[])
    add_probe(app, {"Who": _who})
    usage = grpc.unary_unary_rpc_method_handler(_usage)
    app.server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(peers.ADMISSION, {"GetUsage": usage}),)
    )
    await app.start()
    return app


async def _who_is(pki: Pki, app: GrpcService, path: str | None, **extra: Any) -> str:
    async with pki.identity(path, **extra).channel(app.address) as channel:
        return (await call(channel, "Who")).decode()


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (None, {"dns_names": [f"{TD}/operator/evil"]}),  # a DNS SAN spelled as a SPIFFE ID
        (None, {"emails": [f"{TD}/operator/evil"]}),  # an e-mail SAN spelled so
        ("client/acme", {"extra_uris": ["urn:x"]}),  # a urn: URI beside the SPIFFE ID
        ("client/acme", {"extra_uris": ["https://acme.example/"]}),
        ("client/acme", {"extra_uris": [f"{TD}/client/globex"]}),  # two SPIFFE IDs
        ("client/acme\x00evil", {}),  # grpcio's property strings end at the NUL
    ],
)
async def test_only_one_uri_san_that_is_a_spiffe_id_is_an_identity(
    pki: Pki, path: str | None, extra: dict[str, Any]
) -> None:
    app = await _probe(pki, **pki.server_settings(policy=POLICY))
    try:
        # A real identity first, so a cache keyed by the SAN text would answer wrongly.
        assert await _who_is(pki, app, "operator/evil") == f"{TD}/operator/evil"
        assert await _who_is(pki, app, "client/acme") == f"{TD}/client/acme"
        async with pki.identity(path, **extra).channel(app.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, "Who")
        assert decode(refused.value).code == grpc.StatusCode.UNAUTHENTICATED
    finally:
        await app.stop()


async def test_a_peer_channel_refuses_a_server_with_another_spiffe_id(pki: Pki) -> None:
    """Both servers hold valid server certificates of the test CA; only the one
    whose SPIFFE ID is admission's is accepted as admission."""
    real = await _probe(pki, **pki.server_settings("service/admission", policy=POLICY))
    impostor = await _probe(pki, **pki.server_settings("service/substrate", policy=POLICY))
    me = pki.identity("service/affinity")
    request = admission_pb2.GetUsageRequest(client=common_pb2.ActivationClient(client_id="a"))
    try:
        for app, accepted in ((real, True), (impostor, False)):
            peer = peers.admission(settings(**me.settings(), **pki.peer_ids()), target=app.address)
            try:
                if accepted:
                    answer = await peer.stub.GetUsage(request)
                    assert answer.key.key == f"{TD}/service/affinity"
                    continue
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await peer.stub.GetUsage(request)
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert "Hostname Verification Check failed" in (refused.value.details() or "")
            finally:
                await peer.close()
    finally:
        await real.stop()
        await impostor.stop()


async def test_a_client_certificate_cannot_serve_even_with_the_servers_name(pki: Pki) -> None:
    """A sandbox-class (client-only) certificate that even carries admission's server
    name: BoringSSL refuses it as a server certificate (no serverAuth)."""
    forged = pki.identity("sandbox", dns_names=[server_name(f"{TD}/service/admission")])
    app = await _probe(
        pki, **forged.settings(), authz_policy_file=pki.policy(POLICY), **pki.peer_ids()
    )
    me = pki.identity("service/affinity")
    peer = peers.admission(settings(**me.settings(), **pki.peer_ids()), target=app.address)
    request = admission_pb2.GetUsageRequest(client=common_pb2.ActivationClient(client_id="a"))
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await peer.stub.GetUsage(request)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "unsupported certificate purpose" in (refused.value.details() or "")
    finally:
        await peer.close()
        await app.stop()


async def test_a_server_certificate_cannot_call_as_a_client_only_when_it_lacks_client_auth(
    pki: Pki,
) -> None:
    """The server side checks the client's usage too: a serverAuth-only certificate
    gets no connection (the local PKI never issues one; cert-manager could)."""
    app = await _probe(pki, **pki.server_settings(policy=POLICY))
    server_only = pki.ca.issue(pki.spiffe("client/acme"))
    # Rebuild it with serverAuth alone, from the same CA.
    from cryptography.hazmat.primitives import hashes, serialization

    cert = x509.load_pem_x509_certificate(server_only.cert_pem)
    builder = (
        x509.CertificateBuilder()
        .subject_name(cert.subject)
        .issuer_name(cert.issuer)
        .public_key(cert.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(cert.not_valid_before_utc)
        .not_valid_after(cert.not_valid_after_utc)
    )
    for extension in cert.extensions:
        if isinstance(extension.value, x509.ExtendedKeyUsage):
            builder = builder.add_extension(
                x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), extension.critical
            )
        else:
            builder = builder.add_extension(extension.value, extension.critical)
    pem = builder.sign(pki.ca.key, hashes.SHA256()).public_bytes(serialization.Encoding.PEM)
    credentials = grpc.ssl_channel_credentials(pki.ca.cert_pem, server_only.key_pem, pem)
    try:
        async with grpc.aio.secure_channel(app.address, credentials) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, "Who")
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await app.stop()


def _usages(cert: x509.Certificate) -> list[x509.ObjectIdentifier]:
    return list(cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value)


def _names(cert: x509.Certificate) -> tuple[list[str], list[str], list[Any]]:
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    return (
        san.get_values_for_type(x509.UniformResourceIdentifier),
        san.get_values_for_type(x509.DNSName),
        san.get_values_for_type(x509.IPAddress),
    )


def test_the_local_pki_gives_each_role_only_its_usages_and_names(tmp_path: Path) -> None:
    holders = {
        "admission": "service/admission",
        "cli": "operator/turnstilectl",
        "worker": "sandbox",
    }
    _, issued = ensure_local_pki(tmp_path, "turnstile.local", holders, servers={"admission"})
    load = {n: x509.load_pem_x509_certificate(i.cert_file.read_bytes()) for n, i in issued.items()}
    uris, dns, ips = _names(load["admission"])
    assert uris == ["spiffe://turnstile.local/service/admission"]
    assert dns == ["admission.service.turnstile.local", "localhost"]
    assert {str(ip) for ip in ips} == {"127.0.0.1", "::1"}
    assert _usages(load["admission"]) == [
        ExtendedKeyUsageOID.SERVER_AUTH,
        ExtendedKeyUsageOID.CLIENT_AUTH,
    ]
    for client in ("cli", "worker"):
        uris, dns, ips = _names(load[client])
        assert uris == [f"spiffe://turnstile.local/{holders[client]}"]
        assert (dns, ips) == ([], [])
        assert _usages(load[client]) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_the_local_pki_reissues_a_certificate_of_the_old_shape(tmp_path: Path) -> None:
    """A stack directory from before (every leaf serverAuth, with loopback names) gets
    the worker's certificate re-issued as a client one on the next start."""
    holders = {"worker": "sandbox"}
    ca_file, issued = ensure_local_pki(tmp_path, "turnstile.local", holders)
    from turnstile_platform.pki import CertificateAuthority

    ca = CertificateAuthority.load(ca_file, tmp_path / "ca.key")
    old = ca.issue(
        "spiffe://turnstile.local/sandbox",
        server=True,
        dns_names=["localhost"],
        ip_addresses=["127.0.0.1"],
    )
    old.write(issued["worker"].cert_file, issued["worker"].key_file)
    ensure_local_pki(tmp_path, "turnstile.local", holders)
    cert = x509.load_pem_x509_certificate(issued["worker"].cert_file.read_bytes())
    assert _usages(cert) == [ExtendedKeyUsageOID.CLIENT_AUTH]
    assert _names(cert)[1:] == ([], [])


def test_server_names_are_derived_from_spiffe_ids_and_refuse_the_underivable() -> None:
    assert server_name("spiffe://turnstile.local/service/admission") == (
        "admission.service.turnstile.local"
    )
    for bad in (
        "spiffe://td",
        "spiffe://td/service/Admission",
        "spiffe://td/a.b",
        "spiffe://td/_x",
    ):
        with pytest.raises(ValueError, match="server"):
            server_name(bad)
