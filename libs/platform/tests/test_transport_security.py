"""Mutual TLS on the real bootstrap (SPEC Z1, Z4, Z5): who gets a connection, who gets
an identity, that certificates rotate without a restart, and that plaintext is
loopback-only and explicit."""

from __future__ import annotations

import asyncio
import logging
import shutil
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_platform.errors import decode
from turnstile_platform.identity import parse_spiffe_id
from turnstile_platform.pki import CertificateAuthority
from turnstile_platform.runner import EXIT_MISCONFIGURED, run_service
from turnstile_platform.server import GrpcService
from turnstile_platform.settings import ServiceSettings
from turnstile_platform.tls import (
    TransportSecurityError,
    client_source,
    is_loopback,
    target_hosts,
)
from turnstile_testing.pki import Pki
from turnstile_testing.probe import add_probe, call, settings
from turnstile_testing.processes import free_port


async def _echo(payload: bytes, _: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return payload


async def _start(pki: Pki, **extra: Any) -> GrpcService:
    app = GrpcService("probe", settings(**pki.server_settings(**extra)), service_names=[])
    add_probe(app, {"Echo": _echo})
    await app.start()
    return app


async def test_a_client_certificate_from_the_trusted_ca_is_served(pki: Pki) -> None:
    app = await _start(pki)
    try:
        async with pki.identity("client/acme").channel(app.address) as channel:
            assert await call(channel, "Echo", b"hi") == b"hi"
    finally:
        await app.stop()


async def test_plaintext_and_another_ca_and_no_certificate_get_no_connection(
    pki: Pki,
) -> None:
    app = await _start(pki)
    stranger = Pki(pki.directory / "other")
    try:
        nobody = grpc.ssl_channel_credentials(root_certificates=pki.ca_file.read_bytes())
        for channel in (
            grpc.aio.insecure_channel(app.address),
            stranger.identity("client/acme").channel(app.address),
            grpc.aio.secure_channel(app.address, nobody),
        ):
            async with channel:
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await call(channel, "Echo")
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        await app.stop()


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (None, {}),  # a DNS and IP SAN, no URI
        (None, {"common_name": "spiffe://turnstile.test/client/acme"}),  # the CN is no identity
        ("client/acme", {"extra_uris": ["https://acme.example/"]}),  # two URI SANs
        (None, {"extra_uris": ["spiffe://turnstile.test/client/../admin"]}),  # malformed
    ],
)
async def test_a_certificate_without_one_valid_spiffe_id_is_unauthenticated(
    pki: Pki, path: str | None, extra: dict[str, Any]
) -> None:
    app = await _start(pki)
    try:
        async with pki.identity(path, **extra).channel(app.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, "Echo")
        error = decode(refused.value)
        assert error.code == grpc.StatusCode.UNAUTHENTICATED
        assert error.reason == "UNAUTHENTICATED"
        assert error.metadata["method"] == "test.Probe/Echo"
    finally:
        await app.stop()


def test_spiffe_ids_follow_the_spiffe_rules() -> None:
    assert parse_spiffe_id("spiffe://turnstile.local/service/admission") == (
        "turnstile.local",
        "service/admission",
    )
    for bad in (
        "https://turnstile.local/x",
        "spiffe:///x",
        "spiffe://Turnstile.local/x",
        "spiffe://td/a//b",
        "spiffe://td/a/./b",
        "spiffe://td/x?y=1",
        "spiffe://td:8443/x",
        "spiffe://td/x/",
    ):
        with pytest.raises(ValueError, match=r"SPIFFE|trust domain|path"):
            parse_spiffe_id(bad)


async def test_rotated_files_are_used_by_new_connections_without_failing_open_ones(
    pki: Pki,
) -> None:
    """Swap the server's certificate, key and CA bundle for ones from a second CA
    while a client is connected: the connected client keeps working, a client of
    the new CA connects, and nothing restarted."""
    server_settings = pki.server_settings()
    app = GrpcService("probe", settings(**server_settings), service_names=[])
    add_probe(app, {"Echo": _echo})
    await app.start()
    old_client = pki.identity("client/acme").channel(app.address)
    new_pki = Pki(pki.directory / "new")
    new_client = new_pki.identity("client/acme").channel(app.address)
    try:
        assert await call(old_client, "Echo", b"before") == b"before"
        with pytest.raises(grpc.aio.AioRpcError):
            await call(new_client, "Echo")
        # The rotation: both CAs trusted during the overlap, the server's leaf now
        # issued by the new CA (as cert-manager does when its issuer rotates).
        bundle = pki.ca.cert_pem + new_pki.ca.cert_pem
        leaf = new_pki.leaf("service/test", server=True)
        staging = pki.directory / "staging"
        staging.mkdir()
        (staging / "ca.crt").write_bytes(bundle)
        leaf.write(staging / "tls.crt", staging / "tls.key")
        shutil.move(staging / "tls.key", server_settings["tls_key_file"])
        shutil.move(staging / "tls.crt", server_settings["tls_cert_file"])
        shutil.move(staging / "ca.crt", server_settings["tls_ca_file"])
        results = await asyncio.gather(*(call(old_client, "Echo", b"%d" % i) for i in range(50)))
        assert results == [b"%d" % i for i in range(50)]
        await new_client.close(None)
        new_client = new_pki.identity("client/globex").channel(app.address)
        assert await call(new_client, "Echo", b"after") == b"after"
        assert await call(old_client, "Echo", b"still") == b"still"
    finally:
        await old_client.close(None)
        await new_client.close(None)
        await app.stop()


async def test_the_health_port_answers_without_a_certificate(pki: Pki) -> None:
    app = await _start(pki, health_port=free_port())
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.health_port}") as channel:
            response = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            assert response.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.aio.AioRpcError) as refused:
                await call(channel, "Echo")
            assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
    finally:
        await app.stop()


def test_plaintext_is_refused_on_a_non_loopback_address() -> None:
    everywhere = "0.0.0.0"  # noqa: S104
    with pytest.raises(TransportSecurityError, match="not loopback"):
        GrpcService("probe", settings(plaintext=True, host=everywhere), service_names=[])


def test_without_certificates_or_a_policy_the_server_refuses_to_start(pki: Pki) -> None:
    with pytest.raises(TransportSecurityError, match="TLS_CERT_FILE"):
        GrpcService("probe", settings(plaintext=False), service_names=[])
    files = pki.identity("service/test").settings()
    with pytest.raises(TransportSecurityError, match="AUTHZ_POLICY_FILE"):
        GrpcService("probe", settings(**files), service_names=[])


def test_loopback_addresses_are_recognised() -> None:
    assert all(map(is_loopback, ["127.0.0.1", "::1", "[::1]", "localhost", "127.1.2.3"]))
    others = ["0.0.0.0", "10.0.0.1", "admission.turnstile.svc", "::"]  # noqa: S104
    assert not any(map(is_loopback, others))
    assert target_hosts("dns:///admission:50051") == ["admission"]
    assert target_hosts("[::1]:50051") == ["::1"]
    assert target_hosts("127.0.0.1:1") == ["127.0.0.1"]
    assert target_hosts("ipv4:127.0.0.1:1,127.0.0.2:2") == ["127.0.0.1", "127.0.0.2"]
    assert target_hosts("ipv6:[::1]:1,[::1]:2") == ["::1", "::1"]


def test_plaintext_to_an_address_list_needs_every_address_on_loopback() -> None:
    local = settings(plaintext=True)
    relay = "spiffe://td/service/affinity"
    assert client_source(local, "ipv4:127.0.0.1:1,127.0.0.1:2", "worker", server_id=relay) is None
    with pytest.raises(TransportSecurityError, match="not loopback"):
        client_source(local, "ipv4:127.0.0.1:1,10.0.0.1:2", "worker", server_id=relay)


def test_the_local_ca_issues_one_spiffe_uri_san() -> None:
    from cryptography import x509

    leaf = CertificateAuthority.create().issue("spiffe://td/client/acme", dns_names=["x"])
    cert = x509.load_pem_x509_certificate(leaf.cert_pem)
    san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    assert san.get_values_for_type(x509.UniformResourceIdentifier) == ["spiffe://td/client/acme"]


def test_a_misconfigured_process_exits_with_one_line_not_a_traceback(
    capfd: pytest.CaptureFixture[str],
) -> None:
    async def main(loaded: ServiceSettings) -> None:
        GrpcService("probe", loaded, service_names=[])

    everywhere = "0.0.0.0"  # noqa: S104
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    try:
        with pytest.raises(SystemExit) as exited:
            run_service("probe", settings(plaintext=True, host=everywhere, log_format="text"), main)
    finally:  # run_service configured the process's logging: give pytest its own back
        root.handlers[:] = handlers
        root.setLevel(level)
    assert exited.value.code == EXIT_MISCONFIGURED
    logged = capfd.readouterr().err
    assert "refusing to start" in logged
    assert "not loopback" in logged
    assert "Traceback" not in logged
