"""Who a sandbox is charged to (SPEC C1, C4, A1–A4, S2, S7).

On Direct the runtime's "label" is the client label in its runtime record; the
record, the active execution, the runtime and the receipts must always agree,
and an inheriting activation of a NULL record charges ``unattributed`` and
leaves it NULL until a client of its own activates it.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from turnstile_clientkeys import Client, record_value
from turnstile_contracts import common_pb2, substrate_pb2

if TYPE_CHECKING:
    from conftest import Harness


def runtime_label(harness: Harness, sandbox_id: str) -> str | None:
    """The client label the Direct runtime carries (its runtime record)."""
    path = harness.state_dir / sandbox_id / "runtime.json"
    label: str | None = json.loads(path.read_text())["client_label"]
    return label


async def attribution(harness: Harness, sandbox_id: str) -> dict[str, object]:
    [row] = await harness.rows(
        """
        SELECT s.activating_client_id AS record, e.client_label AS execution,
               (SELECT r.client_id FROM receipts r WHERE r.sandbox_id = s.id
                ORDER BY r.id DESC LIMIT 1) AS receipt
        FROM sandboxes s LEFT JOIN executions e ON e.sandbox_id = s.id AND e.ended_at IS NULL
        WHERE s.id = $1
        """,
        sandbox_id,
    )
    return dict(row)


def charged_form(harness: Harness) -> str | None:
    return harness.admission.admits[-1].client.WhichOneof("client")


async def test_inherit_with_no_recorded_client_charges_the_reserved_key_and_keeps_null(
    harness: Harness,
) -> None:
    first = await harness.activate("sb-1", harness.inherit())

    assert charged_form(harness) == "unattributed"
    assert first.key.key == "unattributed"
    assert not first.HasField("charged_client_id")
    assert await attribution(harness, "sb-1") == {
        "record": None,
        "execution": None,
        "receipt": None,
    }
    assert runtime_label(harness, "sb-1") is None

    await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))
    await harness.activate("sb-1", harness.inherit())
    assert charged_form(harness) == "unattributed"
    assert (await attribution(harness, "sb-1"))["record"] is None

    await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))
    await harness.activate("sb-1", "acme")  # a client of its own sets it
    await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))
    again = await harness.activate("sb-1", harness.inherit())

    assert harness.admission.admits[-1].client.client_id == "acme"
    assert again.charged_client_id == "acme"
    assert await attribution(harness, "sb-1") == {
        "record": "acme",
        "execution": "acme",
        "receipt": "acme",
    }
    assert runtime_label(harness, "sb-1") == "acme"


async def test_native_is_recorded_as_native(harness: Harness) -> None:
    response = await harness.activate("sb-1", harness.native())

    assert charged_form(harness) == "native"
    assert response.charged_client_id == "native"
    assert await attribution(harness, "sb-1") == {
        "record": "native",
        "execution": "native",
        "receipt": "native",
    }


async def test_a_client_id_that_is_no_label_value_is_never_written_as_is(
    harness: Harness,
) -> None:
    response = await harness.activate("sb-1", "Acme Corp")

    assert harness.admission.admits[-1].client.client_id == "Acme Corp"  # charged by its id
    assert response.charged_client_id == "shared"
    assert await attribution(harness, "sb-1") == {
        "record": "shared",
        "execution": "shared",
        "receipt": "shared",
    }
    assert runtime_label(harness, "sb-1") == "shared"


@dataclass(frozen=True)
class Step:
    action: str  # activate | deactivate
    sandbox: int
    client: str  # a client id, "<native>" or "<inherit>"


CLIENTS = ["acme", "globex", "Not A Label", "<native>", "<inherit>"]
STEPS = st.lists(
    st.builds(
        Step,
        action=st.sampled_from(["activate", "deactivate"]),
        sandbox=st.integers(0, 1),
        client=st.sampled_from(CLIENTS),
    ),
    min_size=1,
    max_size=12,
)


def contract_client(name: str) -> common_pb2.ActivationClient:
    if name == "<native>":
        return common_pb2.ActivationClient(native=common_pb2.ActivationClient.Native())
    if name == "<inherit>":
        return common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())
    return common_pb2.ActivationClient(client_id=name)


def model_client(name: str, recorded: str | None) -> Client:
    if name == "<native>":
        return Client.native()
    if name == "<inherit>":
        return Client.from_record(recorded)
    return Client.of(name)


@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(steps=STEPS)
async def test_record_runtime_execution_and_receipt_always_agree(
    harness: Harness, steps: list[Step]
) -> None:
    harness.admission.cap = 1_000_000
    prefix = uuid.uuid4().hex[:8]
    ids = [f"{prefix}-{n}" for n in range(2)]
    #: The model: each sandbox's expected record (absent key: no record yet).
    recorded: dict[str, str | None] = {}
    running: set[str] = set()
    try:
        for step in steps:
            sandbox_id = ids[step.sandbox]
            if step.action == "deactivate":
                await harness.stub.Deactivate(
                    substrate_pb2.DeactivateRequest(sandbox_id=sandbox_id)
                )
                running.discard(sandbox_id)
                continue
            response = await harness.activate(sandbox_id, contract_client(step.client))
            if sandbox_id in running:
                assert response.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING
            else:
                charged = model_client(step.client, recorded.get(sandbox_id))
                recorded[sandbox_id] = record_value(charged)
                running.add(sandbox_id)
            expected = recorded[sandbox_id]
            state = await attribution(harness, sandbox_id)
            assert state == {"record": expected, "execution": expected, "receipt": expected}
            assert runtime_label(harness, sandbox_id) == expected
            assert (
                response.charged_client_id if response.HasField("charged_client_id") else None
            ) == expected
    finally:
        for sandbox_id in ids:
            await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=sandbox_id))
