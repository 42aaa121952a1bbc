"""GetSandbox, ListSandboxes, health and substrate selection."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_clientkeys import Resolver
from turnstile_contracts import substrate_pb2
from turnstile_substrate import substrates
from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.settings import SubstrateSettings

if TYPE_CHECKING:
    from conftest import Harness


async def test_get_sandbox_shows_the_record_the_runtime_and_the_charged_client(
    harness: Harness,
) -> None:
    activated = await harness.activate("sb-1", "acme", tier="gpu")

    found = await harness.stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id="sb-1"))

    sandbox = found.sandbox
    assert sandbox.sandbox_id == "sb-1"
    assert sandbox.state == substrate_pb2.SANDBOX_STATE_RUNNING
    assert sandbox.runtime_name == activated.sandbox.runtime_name
    assert sandbox.activating_client_id == "acme"
    assert sandbox.tier == "gpu"
    assert sandbox.substrate == "direct"
    assert sandbox.created_at.seconds > 0


async def test_get_sandbox_of_an_unknown_sandbox_is_not_found(harness: Harness) -> None:
    error = await harness.error(
        harness.stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id="nope"))
    )
    assert error.code == grpc.StatusCode.NOT_FOUND
    assert error.reason == "NOT_FOUND"


async def test_a_sandbox_without_a_recorded_client_shows_no_client(harness: Harness) -> None:
    activated = await harness.activate("sb-1", harness.inherit())

    found = await harness.stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id="sb-1"))

    assert not activated.HasField("charged_client_id")
    assert not found.sandbox.HasField("activating_client_id")


async def test_list_sandboxes_pages_newest_first_and_filters_by_client(
    harness: Harness,
) -> None:
    for n in range(5):
        await harness.activate(f"sb-{n}", "acme" if n % 2 == 0 else "globex")

    seen: list[str] = []
    token = ""
    pages = 0
    while True:
        page = await harness.stub.ListSandboxes(
            substrate_pb2.ListSandboxesRequest(page_size=2, page_token=token)
        )
        seen += [s.sandbox_id for s in page.sandboxes]
        pages += 1
        token = page.next_page_token
        if not token:
            break

    assert seen == ["sb-4", "sb-3", "sb-2", "sb-1", "sb-0"]
    assert pages == 3
    acme = await harness.stub.ListSandboxes(substrate_pb2.ListSandboxesRequest(client_id="acme"))
    assert [s.sandbox_id for s in acme.sandboxes] == ["sb-4", "sb-2", "sb-0"]
    assert acme.next_page_token == ""


async def test_the_service_is_serving_with_every_component_healthy(harness: Harness) -> None:
    health = health_pb2_grpc.HealthStub(harness.channel)

    response = await health.Check(health_pb2.HealthCheckRequest(service=""))

    assert response.status == health_pb2.HealthCheckResponse.SERVING
    assert harness.app.health.components == {"postgres": True, "substrate": True}


def test_the_direct_substrate_is_the_default() -> None:
    # Named so a root test run is not refused (who runtimes run as: SPEC O4).
    settings = SubstrateSettings(direct_runtime_user=str(os.getuid()))
    substrate = substrates.create_substrate(settings, Resolver())
    assert isinstance(substrate, DirectSubstrate)


def test_choosing_a_substrate_this_build_lacks_fails_start_up_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(substrates, "KUBERNETES_MODULE", "turnstile_substrate.not_in_this_build")

    with pytest.raises(substrates.SubstrateUnavailableError, match="no Kubernetes substrate"):
        substrates.create_substrate(SubstrateSettings(substrate_kind="kubernetes"), Resolver())
