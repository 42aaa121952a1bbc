"""Bad input is INVALID_ARGUMENT naming every bad field, and changes nothing (SPEC X2)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import grpc
import pytest

from turnstile_contracts import common_pb2, substrate_pb2
from turnstile_platform.errors import RichError
from turnstile_platform.tiers import TierConfig, parse_tiers
from turnstile_substrate import contract

if TYPE_CHECKING:
    from conftest import Harness

Client = common_pb2.ActivationClient


def activate(
    sandbox_id: str = "sb-1", client: Client | None = None, tier: str = ""
) -> substrate_pb2.ActivateRequest:
    return substrate_pb2.ActivateRequest(
        sandbox_id=sandbox_id,
        client=client if client is not None else Client(client_id="acme"),
        tier=tier,
    )


@pytest.mark.parametrize(
    ("request_", "fields"),
    [
        (activate(sandbox_id=""), ["sandbox_id"]),
        (activate(sandbox_id="x" * 64), ["sandbox_id"]),
        (activate(sandbox_id="Not a label!"), ["sandbox_id"]),
        (activate(sandbox_id="-leading"), ["sandbox_id"]),
        (substrate_pb2.ActivateRequest(sandbox_id="sb-1"), ["client"]),
        (activate(client=Client(client_id="")), ["client.client_id"]),
        (activate(client=Client(client_id="native")), ["client.client_id"]),
        (activate(client=Client(client_id="unattributed")), ["client.client_id"]),
        (activate(client=Client(client_id="x" * 254)), ["client.client_id"]),
        (activate(client=Client(unattributed=Client.Unattributed())), ["client.unattributed"]),
        (activate(tier="no spaces"), ["tier"]),
        (activate(sandbox_id="", client=Client(client_id=""), tier="?"), None),
    ],
    ids=lambda value: "" if not isinstance(value, list) else ",".join(value),
)
def test_a_bad_activate_request_names_its_fields(
    request_: substrate_pb2.ActivateRequest, fields: list[str] | None
) -> None:
    with pytest.raises(RichError) as raised:
        contract.activate_request(request_, TierConfig())

    error = raised.value
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INVALID_FIELD"
    named = [v.field for v in error.field_violations]
    assert named == (fields or ["sandbox_id", "client.client_id", "tier"])
    assert error.metadata["field"] == named[0]


def test_an_empty_tier_is_the_default_tier_and_an_undeclared_one_is_refused() -> None:
    tiers = parse_tiers("container,microvm", "microvm")
    assert contract.activate_request(activate(tier=""), tiers)[2] == "microvm"
    assert contract.activate_request(activate(tier="container"), tiers)[2] == "container"
    with pytest.raises(RichError) as raised:
        contract.activate_request(activate(tier="gpu"), tiers)
    assert [v.field for v in raised.value.field_violations] == ["tier"]
    # No tiers configured: any label value goes, and empty stays empty (no label).
    assert contract.activate_request(activate(tier=""), TierConfig())[2] == ""


def test_a_client_id_that_is_no_label_value_is_accepted_and_charged_as_shared() -> None:
    sandbox_id, client, tier = contract.activate_request(
        activate(client=Client(client_id="Acme Corp")), TierConfig()
    )
    assert (sandbox_id, client.client_id, tier) == ("sb-1", "Acme Corp", "")


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (substrate_pb2.CountLiveSandboxesRequest(key=""), "key"),
        (substrate_pb2.CountLiveSandboxesRequest(key="a b"), "key"),
        (
            substrate_pb2.CountLiveSandboxesRequest(key="acme", exclude_sandbox_id="a b"),
            "exclude_sandbox_id",
        ),
        (
            substrate_pb2.CountLiveSandboxesRequest(
                key="acme", pending_sandbox_ids=["ok", "not ok"]
            ),
            "pending_sandbox_ids[1]",
        ),
        (
            substrate_pb2.CountLiveSandboxesRequest(
                key="acme", pending_sandbox_ids=[f"sb-{n}" for n in range(10_001)]
            ),
            "pending_sandbox_ids",
        ),
    ],
    ids=["empty-key", "bad-key", "bad-exclude", "bad-pending-id", "too-many-pending"],
)
def test_a_bad_count_request_names_its_field(
    request_: substrate_pb2.CountLiveSandboxesRequest, field: str
) -> None:
    with pytest.raises(RichError) as raised:
        contract.count_request(request_)
    assert [v.field for v in raised.value.field_violations] == [field]


@pytest.mark.parametrize(
    ("request_", "field"),
    [
        (substrate_pb2.ListSandboxesRequest(page_size=1001), "page_size"),
        (substrate_pb2.ListSandboxesRequest(page_size=-1), "page_size"),
        (substrate_pb2.ListSandboxesRequest(page_token="garbage!"), "page_token"),
        (substrate_pb2.ListSandboxesRequest(page_token="bm9jb2xvbg"), "page_token"),
        (substrate_pb2.ListSandboxesRequest(client_id="x" * 254), "client_id"),
    ],
    ids=["page-too-big", "page-negative", "token-not-base64", "token-no-cursor", "long-client"],
)
def test_a_bad_list_request_names_its_field(
    request_: substrate_pb2.ListSandboxesRequest, field: str
) -> None:
    with pytest.raises(RichError) as raised:
        contract.list_request(request_)
    assert [v.field for v in raised.value.field_violations] == [field]


async def test_bad_input_over_the_wire_changes_nothing_and_asks_admission_nothing(
    harness: Harness,
) -> None:
    await harness.activate("sb-0", "acme")
    before = await harness.rows("SELECT * FROM sandboxes")

    calls: list[Callable[[], Awaitable[object]]] = [
        lambda: harness.activate("", "acme"),
        lambda: harness.activate("sb-1", Client(unattributed=Client.Unattributed())),
        lambda: harness.activate("sb-1", "acme", tier="no spaces"),
        lambda: harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb 0")),
        lambda: harness.stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id="")),
    ]
    for call in calls:
        error = await harness.error(call())
        assert error.code == grpc.StatusCode.INVALID_ARGUMENT, error
        assert error.field_violations

    assert await harness.rows("SELECT * FROM sandboxes") == before
    assert len(harness.admission.admits) == 1
    assert harness.admission.released == []
    assert list(harness.processes()) == ["sb-0"]
