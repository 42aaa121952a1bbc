"""The cap gate a substrate runs before every runtime it creates (SPEC S5, P1),
against the stand-in admission service over a real socket."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc
import pytest

from turnstile_clientkeys import Client
from turnstile_contracts import admission_pb2
from turnstile_platform import peers
from turnstile_platform.errors import RichError
from turnstile_substrate.admission_client import AdmissionClient, Admitted
from turnstile_substrate.runtime import CreateKind
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.processes import free_port

if TYPE_CHECKING:
    from conftest import AdmissionDouble, Harness

ACME = Client.of("acme")


def client_for(address: str) -> AdmissionClient:
    settings = SubstrateSettings(admission_addr=address)
    return AdmissionClient(peers.admission(settings, None), retry_after_s=1.0, timeout_s=2.0)


@pytest.fixture
async def client(admission: AdmissionDouble) -> AsyncIterator[AdmissionClient]:
    admission_client = client_for(admission.address)
    try:
        yield admission_client
    finally:
        await admission_client.close()


async def admit(client: AdmissionClient, sandbox_id: str = "sb-1") -> Admitted:
    return await client.admit(sandbox_id, ACME, CreateKind.COLD, "", ())


async def test_the_gate_passes_while_live_and_pending_stay_within_the_cap(
    client: AdmissionClient, admission: AdmissionDouble
) -> None:
    admission.cap = 1
    admitted = await admit(client)

    await client.cap_gate(admitted, ACME)()

    assert admission.usage_calls == 1


async def test_the_gate_refuses_when_the_cap_was_reached_since_admit(
    client: AdmissionClient, admission: AdmissionDouble
) -> None:
    admission.cap = 2
    admitted = await admit(client)
    admission.extra_pending = 2  # two more activations admitted meanwhile

    with pytest.raises(RichError) as raised:
        await client.cap_gate(admitted, ACME)()

    error = raised.value
    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.reason == "CAP_EXCEEDED"
    assert error.metadata["limit"] == "2"
    assert error.metadata["current"] == "2"
    assert [v.subject for v in error.quota_violations] == ["acme"]
    assert error.retryable


@pytest.mark.parametrize(("extra", "refused"), [(1, False), (2, True)], ids=["room", "full"])
async def test_without_a_live_count_the_gate_decides_on_the_pending_set_alone(
    client: AdmissionClient, admission: AdmissionDouble, extra: int, refused: bool
) -> None:
    """An unavailable count is a lower bound of zero, not a pass (SPEC S4)."""
    admission.cap = 2
    admission.live_unavailable = True
    admitted = await admit(client)
    admission.extra_pending = extra  # this activation's own entry, plus others

    gate = client.cap_gate(admitted, ACME)
    if not refused:
        await gate()
        return
    with pytest.raises(RichError) as raised:
        await gate()
    assert raised.value.reason == "CAP_EXCEEDED"
    assert raised.value.metadata["current"] == "2"
    assert "live count unavailable" in raised.value.message


@pytest.mark.parametrize(
    ("mode", "verdict"),
    [
        (admission_pb2.POLICY_MODE_SHADOW, admission_pb2.VERDICT_PASS),
        (admission_pb2.POLICY_MODE_OFF, admission_pb2.VERDICT_SKIPPED),
        (admission_pb2.POLICY_MODE_ENFORCE, admission_pb2.VERDICT_UNKNOWN),
    ],
    ids=["shadow", "off", "count-unsupported"],
)
async def test_the_gate_asks_nothing_when_the_cap_cannot_refuse(
    client: AdmissionClient,
    admission: AdmissionDouble,
    mode: admission_pb2.PolicyMode.ValueType,
    verdict: admission_pb2.Verdict.ValueType,
) -> None:
    admission.cap_mode, admission.cap_verdict = mode, verdict
    admission.extra_pending = 100
    admitted = await admit(client)

    await client.cap_gate(admitted, ACME)()

    assert admission.usage_calls == 0


async def test_the_gate_fails_closed_when_admission_is_unreachable() -> None:
    unreachable = client_for(f"127.0.0.1:{free_port()}")
    cap = admission_pb2.PolicyVerdict(
        policy=admission_pb2.POLICY_CAP,
        mode=admission_pb2.POLICY_MODE_ENFORCE,
        verdict=admission_pb2.VERDICT_PASS,
    )
    admitted = Admitted(hold_id="h", key=admission_pb2.AdmitResponse().key, node="", cap=cap)
    try:
        with pytest.raises(RichError) as raised:
            await unreachable.cap_gate(admitted, ACME)()
    finally:
        await unreachable.close()
    assert raised.value.code == grpc.StatusCode.UNAVAILABLE
    assert raised.value.retryable


async def test_an_activation_refused_by_the_gate_cancels_its_hold_and_leaves_nothing(
    harness: Harness,
) -> None:
    harness.admission.cap = 3
    harness.admission.extra_pending = 3

    error = await harness.error(harness.activate("sb-1", "acme"))

    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.reason == "CAP_EXCEEDED"
    assert [h.state for h in harness.admission.holds.values()] == ["cancelled"]
    assert harness.processes() == {}
    assert await harness.rows("SELECT id FROM sandboxes") == []
