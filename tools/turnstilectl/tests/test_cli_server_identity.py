"""turnstilectl checks the server's SPIFFE ID (SPEC O5): against real mTLS servers
of a test CA, a server holding another service's identity is refused with a message
that says so, not mistaken for the service."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from turnstile_cli.cli import run
from turnstile_platform.server import GrpcService
from turnstile_testing.pki import Pki
from turnstile_testing.probe import settings


@pytest.fixture
async def admission_server(pki: Pki, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[str]:
    """A server holding the test trust domain's admission identity; the CLI is told
    to expect this trust domain's services, over mTLS."""
    monkeypatch.delenv("TURNSTILE_PLAINTEXT", raising=False)  # the test kit's default
    for service, identity in pki.peer_ids().items():
        monkeypatch.setenv(f"TURNSTILE_{service.upper()}", identity)
    overrides = pki.server_settings("service/admission")
    app = GrpcService("probe", settings(**overrides), service_names=[])
    await app.start()
    try:
        yield app.address
    finally:
        await app.stop()


def _flags(pki: Pki, address: str) -> list[str]:
    me = pki.identity("operator/cli")
    return [
        *(f"--{s}={address}" for s in ("admission", "substrate", "affinity")),
        f"--cert={me.cert_file}",
        f"--key={me.key_file}",
        f"--ca={me.ca_file}",
        "--color=never",
    ]


async def test_status_tells_the_expected_service_from_an_impostor(
    admission_server: str, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    """One server answers at all three addresses: it is admission, so the substrate
    and affinity it poses as are refused."""
    code = await asyncio.to_thread(run, [*_flags(pki, admission_server), "--json", "status"])
    answer = json.loads(capsys.readouterr().out)
    health = {name: answer[name]["health"] for name in ("admission", "substrate", "affinity")}
    assert health == {
        "admission": "SERVING",
        "substrate": "WRONG_IDENTITY",
        "affinity": "WRONG_IDENTITY",
    }
    assert code != 0


async def test_a_command_against_a_server_with_the_wrong_identity_says_so(
    admission_server: str, pki: Pki, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = [*_flags(pki, admission_server), "sandboxes", "sb-1"]
    code = await asyncio.to_thread(run, argv)
    err = " ".join(capsys.readouterr().err.split())
    assert code != 0
    assert "not the Turnstile service expected" in err
    assert "SPIFFE ID" in err
