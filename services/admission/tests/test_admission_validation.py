"""Bad input gets INVALID_ARGUMENT naming the field and changes no Redis key."""

from __future__ import annotations

from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission import validation
from turnstile_admission.validation import MAX_REMEMBERED
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform.errors import RichError, decode

ACME = common_pb2.ActivationClient(client_id="acme")
COLD = common_pb2.ACTIVATION_KIND_COLD_CREATE


def admit(**fields: Any) -> admission_pb2.AdmitRequest:
    values: dict[str, Any] = {"sandbox_id": "sb-1", "client": ACME, "kind": COLD, **fields}
    return admission_pb2.AdmitRequest(**values)


BAD_ADMITS = [
    pytest.param(admit(kind=common_pb2.ACTIVATION_KIND_UNSPECIFIED), "kind", id="unspecified-kind"),
    pytest.param(admit(kind=99), "kind", id="unknown-kind"),
    pytest.param(admit(sandbox_id=""), "sandbox_id", id="empty-sandbox-id"),
    pytest.param(admit(sandbox_id="s" * 64), "sandbox_id", id="oversized-sandbox-id"),
    pytest.param(admit(sandbox_id="Not Valid!"), "sandbox_id", id="bad-sandbox-id"),
    pytest.param(admit(client=common_pb2.ActivationClient()), "client", id="empty-client"),
    pytest.param(
        admit(client=common_pb2.ActivationClient(client_id="")),
        "client.client_id",
        id="empty-client-id",
    ),
    pytest.param(
        admit(client=common_pb2.ActivationClient(client_id="c" * 254)),
        "client.client_id",
        id="oversized-client-id",
    ),
    pytest.param(
        admit(client=common_pb2.ActivationClient(client_id="native")),
        "client.client_id",
        id="reserved-client-id",
    ),
    pytest.param(
        admit(client=common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())),
        "client.inherit",
        id="inherit",
    ),
    pytest.param(admit(tier="no spaces"), "tier", id="bad-tier"),
    pytest.param(admit(wait_id="w" * 65), "wait_id", id="oversized-wait-id"),
    pytest.param(admit(wait_id="not/a wait"), "wait_id", id="bad-wait-id"),
    pytest.param(admit(candidate_nodes=["n1", ""]), "candidate_nodes[1]", id="empty-node"),
    pytest.param(admit(candidate_nodes=["n1", "n1"]), "candidate_nodes[1]", id="duplicate-node"),
    pytest.param(
        admit(candidate_nodes=[f"n{i}" for i in range(257)]),
        "candidate_nodes",
        id="too-many-nodes",
    ),
]


async def assert_invalid(call: Any, field: str) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    error = decode(raised.value)
    assert error.reason == "INVALID_FIELD"
    assert [v.field for v in error.field_violations] == [field]


async def snapshot(client: aioredis.Redis, prefix: str) -> dict[bytes, bytes | None]:
    keys = sorted([k async for k in client.scan_iter(match=f"{prefix}*", count=1000)])
    return {k: await client.dump(k) for k in keys}


@pytest.mark.parametrize(("request_", "field"), BAD_ADMITS)
async def test_bad_admit_is_invalid_argument_naming_the_field_and_changes_nothing(
    admission: Any,
    redis: aioredis.Redis,
    redis_prefix: str,
    request_: admission_pb2.AdmitRequest,
    field: str,
) -> None:
    before = await snapshot(redis, redis_prefix)
    await assert_invalid(admission.stub.Admit(request_), field)
    assert await snapshot(redis, redis_prefix) == before


@pytest.mark.parametrize("hold_id", ["", "h" * 65, "not/a hold"])
async def test_bad_hold_id_is_invalid_argument_for_commit_and_cancel(
    admission: Any, redis: aioredis.Redis, redis_prefix: str, hold_id: str
) -> None:
    before = await snapshot(redis, redis_prefix)
    await assert_invalid(
        admission.stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=hold_id)), "hold_id"
    )
    await assert_invalid(
        admission.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=hold_id)), "hold_id"
    )
    assert await snapshot(redis, redis_prefix) == before


async def test_bad_release_and_usage_requests_are_invalid_argument(admission: Any) -> None:
    await assert_invalid(
        admission.stub.ReleaseSandbox(admission_pb2.ReleaseSandboxRequest(sandbox_id="")),
        "sandbox_id",
    )
    await assert_invalid(
        admission.stub.GetUsage(
            admission_pb2.GetUsageRequest(
                client=common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())
            )
        ),
        "client.inherit",
    )


@pytest.mark.parametrize("wait_id", ["", "w" * 65, "not/a wait"])
async def test_a_bad_queue_position_request_is_invalid_argument(
    admission: Any, wait_id: str
) -> None:
    request = admission_pb2.GetQueuePositionRequest(client=ACME, wait_id=wait_id)
    await assert_invalid(admission.stub.GetQueuePosition(request), "wait_id")


GOOD = admit(candidate_nodes=["n1", "n2"])


@pytest.mark.parametrize("remembered", [MAX_REMEMBERED, 0], ids=["remembering", "full"])
def test_remembered_client_ids_and_node_names_refuse_what_they_refused(
    monkeypatch: pytest.MonkeyPatch, remembered: int
) -> None:
    """Valid client ids and node names are remembered, not validated again; a bad
    one is refused as before, whether the sets remember or are full."""
    monkeypatch.setattr(validation, "_clients", {})
    monkeypatch.setattr(validation, "_nodes", set())
    monkeypatch.setattr(validation, "MAX_REMEMBERED", remembered)
    for _ in range(2):
        accepted = validation.admit_request(GOOD)
        assert (accepted.client.client_id, accepted.candidate_nodes) == ("acme", ("n1", "n2"))
    assert len(validation._clients) == len(validation._nodes) / 2 == min(remembered, 1)
    for param in BAD_ADMITS:
        request_, field = param.values
        with pytest.raises(RichError) as raised:
            validation.admit_request(request_)  # type: ignore[arg-type]
        assert [v.field for v in raised.value.field_violations] == [field]
    # A name both bad and duplicated is refused for the first problem met, in order.
    with pytest.raises(RichError) as raised:
        validation.admit_request(admit(candidate_nodes=["n1", "n1", "bad name"]))
    assert [v.field for v in raised.value.field_violations] == ["candidate_nodes[1]"]
