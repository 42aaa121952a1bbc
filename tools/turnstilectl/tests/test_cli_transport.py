"""A certificate problem is not a down server: against a real mTLS server of a test
CA, each wrong file gets its own one-line explanation and exit 5, and gRPC core's
handshake log never reaches the terminal."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from turnstile_cli.cli import run
from turnstile_cli.exits import Exit
from turnstile_platform.pki import CertificateAuthority
from turnstile_platform.server import GrpcService
from turnstile_testing.pki import Pki
from turnstile_testing.probe import settings


@pytest.fixture
async def admission_server(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """A real mTLS server holding the test trust domain's admission identity."""
    monkeypatch.delenv("TURNSTILE_PLAINTEXT", raising=False)
    for service, identity in pki.peer_ids().items():
        monkeypatch.setenv(f"TURNSTILE_{service.upper()}", identity)
    app = GrpcService(
        "probe", settings(**pki.server_settings("service/admission")), service_names=[]
    )
    await app.start()
    try:
        yield app.address
    finally:
        await app.stop()


def _argv(address: str, cert: Path, key: Path, ca: Path, *rest: str) -> list[str]:
    return [
        f"--admission={address}",
        f"--cert={cert}",
        f"--key={key}",
        f"--ca={ca}",
        "--color=never",
        *rest,
    ]


async def _usage(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str]:
    code = await asyncio.to_thread(run, [*argv, "usage", "--client", "acme"])
    return code, " ".join(capsys.readouterr().err.split())


def _other_ca_identity(directory: Path, *, self_signed: bool) -> tuple[Path, Path, Path]:
    """A client certificate of another CA (or a self-signed one) and that CA."""
    ca = CertificateAuthority.create()
    directory.mkdir(parents=True, exist_ok=True)
    cert, key, ca_file = directory / "x.crt", directory / "x.key", directory / "ca.crt"
    ca_file.write_bytes(ca.cert_pem)
    if self_signed:
        ca.write(cert, key)  # the CA's own certificate: self-signed
    else:
        ca.issue("spiffe://turnstile.test/operator/cli", server=False).write(cert, key)
    return cert, key, ca_file


async def test_a_self_signed_client_certificate_is_named_not_taken_for_a_down_server(
    admission_server: str, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key, _ = _other_ca_identity(tmp_path / "self", self_signed=True)
    code, err = await _usage(_argv(admission_server, cert, key, pki.ca_file), capsys)
    assert code == Exit.TRANSPORT
    assert f"the client certificate {cert} is self-signed, not by the CA in {pki.ca_file}" in err
    assert "is the service running" not in err


async def test_a_client_certificate_of_another_ca_is_named(
    admission_server: str, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cert, key, _ = _other_ca_identity(tmp_path / "other", self_signed=False)
    code, err = await _usage(_argv(admission_server, cert, key, pki.ca_file), capsys)
    assert code == Exit.TRANSPORT
    assert "is issued by another CA" in err


async def test_a_server_of_another_ca_is_untrusted_in_one_line(
    admission_server: str, pki: Pki, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    me = pki.identity("operator/cli")
    _, _, other_ca = _other_ca_identity(tmp_path / "other", self_signed=False)
    code, err = await _usage(_argv(admission_server, me.cert_file, me.key_file, other_ca), capsys)
    assert code == Exit.TRANSPORT
    assert f"has a certificate not issued by the CA in {other_ca}" in err
    assert "CERTIFICATE_VERIFY_FAILED" not in err


async def test_a_key_that_is_not_the_certificates_is_named(
    admission_server: str, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    me, other = pki.identity("operator/cli"), pki.identity("operator/other")
    code, err = await _usage(
        _argv(admission_server, me.cert_file, other.key_file, pki.ca_file), capsys
    )
    assert code == Exit.TRANSPORT
    assert f"the private key {other.key_file} does not belong to the certificate" in err


async def test_a_wrong_server_identity_is_named_with_whom_was_expected(
    admission_server: str,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    me = pki.identity("operator/cli")
    expected = pki.spiffe("service/substrate")
    monkeypatch.setenv("TURNSTILE_ADMISSION_SPIFFE_ID", expected)
    code, err = await _usage(_argv(admission_server, me.cert_file, me.key_file, me.ca_file), capsys)
    assert code == Exit.TRANSPORT
    assert (
        f"the server at {admission_server} is not the Turnstile service expected ({expected})"
        in err
    )


async def test_plaintext_against_a_tls_server_says_it_expects_tls(
    admission_server: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TURNSTILE_PLAINTEXT", "true")
    code = await asyncio.to_thread(
        run, [f"--admission={admission_server}", "--json", "usage", "--client", "acme"]
    )
    error = json.loads(capsys.readouterr().out)["error"]
    assert code == Exit.TRANSPORT
    assert error["reason"] == "PLAINTEXT_TO_TLS"
    assert "it expects TLS" in error["message"]


async def test_status_shows_a_tls_problem_apart_from_unreachable(
    admission_server: str, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    me, other = pki.identity("operator/cli"), pki.identity("operator/other")
    argv = _argv(admission_server, me.cert_file, other.key_file, pki.ca_file)
    code = await asyncio.to_thread(
        run, [*argv, "--substrate=127.0.0.1:1", "--affinity=127.0.0.1:1", "--json", "status"]
    )
    answer = json.loads(capsys.readouterr().out)
    assert code == Exit.TRANSPORT
    assert answer["admission"]["health"] == "TLS PROBLEM"
    assert answer["admission"]["problem"] == "KEY_MISMATCH"
    assert answer["substrate"]["health"] == "UNREACHABLE"


async def test_no_grpc_core_log_line_reaches_the_terminal(admission_server: str, pki: Pki) -> None:
    """A real process: gRPC core writes its log to file descriptor 2 itself."""
    me, other = pki.identity("operator/cli"), pki.identity("operator/other")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    argv = _argv(admission_server, me.cert_file, other.key_file, pki.ca_file)
    done = await asyncio.to_thread(
        subprocess.run,
        # -q: no target line either (test_cli_targets.py), only the error's.
        [sys.executable, "-m", "turnstile_cli", *argv, "usage", "--client", "acme", "-q"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
    )
    assert done.returncode == Exit.TRANSPORT
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert "does not belong to the certificate" in lines[0]
    for sign in ("ssl_transport_security", "Invalid private key", "handshaker"):
        assert sign not in done.stderr


async def test_the_demo_changes_nothing_against_a_stack_it_cannot_talk_to(
    admission_server: str,
    redis_url: str,
    redis_prefix: str,
    redis: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Plaintext against the mTLS stack: it says why before touching the key set."""
    monkeypatch.setenv("TURNSTILE_PLAINTEXT", "true")
    addresses = [f"--{s}={admission_server}" for s in ("admission", "substrate", "affinity")]
    argv = [*addresses, "demo"]
    code = await asyncio.to_thread(run, argv)
    err = " ".join(capsys.readouterr().err.split())
    assert code == Exit.TRANSPORT
    assert "it expects TLS" in err
    assert [key async for key in redis.scan_iter(match=f"{redis_prefix}*")] == []


@pytest.fixture
async def plaintext_server() -> AsyncIterator[str]:
    app = GrpcService("probe", settings(plaintext=True), service_names=[])
    await app.start()
    try:
        yield app.address
    finally:
        await app.stop()


async def test_tls_against_a_plaintext_server_says_it_serves_plaintext(
    plaintext_server: str,
    pki: Pki,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("TURNSTILE_PLAINTEXT", raising=False)
    me = pki.identity("operator/cli")
    code, err = await _usage(_argv(plaintext_server, me.cert_file, me.key_file, me.ca_file), capsys)
    assert code == Exit.TRANSPORT
    assert f"the server at {plaintext_server} does not speak TLS: it serves plaintext" in err
