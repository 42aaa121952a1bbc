"""The substrate's side of the decision log (SPEC Q3): each Activate's outcome and
why, under the same trace id as admission's decision for it, read back through
ListDecisions — with the real admission and substrate (Direct) services."""

from __future__ import annotations

from typing import Any

import grpc
import pytest

from turnstile_clientkeys.limits import LimitsStore
from turnstile_contracts import admission_pb2, substrate_pb2
from turnstile_testing.eventually import eventually

from .conftest import ADMISSION, SUBSTRATE, Tenants, client

TRACE = "0af7651916cd43dd8448eb211c80319c"


def traced(n: int) -> tuple[tuple[str, str], ...]:
    return (("traceparent", f"00-{TRACE[:-2]}{n:02x}-b7ad6b7169203331-01"),)


async def activate_traced(tenants: Tenants, sandbox_id: str, n: int) -> Any:
    channel = tenants.channels[f"ops@{tenants.substrate.address}"]
    rpc = channel.unary_unary(
        f"/{SUBSTRATE}/Activate",
        request_serializer=substrate_pb2.ActivateRequest.SerializeToString,
        response_deserializer=substrate_pb2.ActivateResponse.FromString,
    )
    request = substrate_pb2.ActivateRequest(sandbox_id=sandbox_id, client=client("acme"))
    return await rpc(request, timeout=20, metadata=traced(n))


async def entries(tenants: Tenants, sandbox_id: str) -> list[Any]:
    page = await tenants.call(
        "ops", ADMISSION, "ListDecisions", admission_pb2.ListDecisionsRequest(sandbox_id=sandbox_id)
    )
    return list(reversed(page.decisions))  # oldest first


async def test_each_activate_is_logged_beside_admissions_decision_under_one_trace(
    tenants: Tenants,
) -> None:
    await activate_traced(tenants, "acme--a", 1)
    await activate_traced(tenants, "acme--a", 2)  # already running: admission not asked

    async def both() -> list[Any] | None:
        found = await entries(tenants, "acme--a")
        return found if len(found) == 3 else None

    found = await eventually(both)
    assert found is not None
    admitted, created, running = found
    assert (admitted.service, admitted.kind) == ("admission", "admitted")
    assert (created.service, created.kind) == ("substrate", "created")
    assert admitted.trace_id == created.trace_id == f"{TRACE[:-2]}01"
    assert created.identity == "spiffe://turnstile.test/operator/ops"
    assert admitted.identity == "spiffe://turnstile.test/service/substrate"
    assert created.detail.startswith("created a new runtime")
    assert (running.service, running.kind, running.trace_id) == (
        "substrate",
        "already_running",
        f"{TRACE[:-2]}02",
    )

    await LimitsStore(tenants.redis, tenants.redis_prefix).put("key:acme", {"concurrency": 0})
    with pytest.raises(grpc.aio.AioRpcError):
        await activate_traced(tenants, "acme--b", 3)

    async def refused() -> list[Any] | None:
        found = await entries(tenants, "acme--b")
        return found if len(found) == 2 else None

    pair = await eventually(refused)
    assert pair is not None
    decision, side = pair
    assert (decision.kind, side.kind) == ("refused", "refused_by_admission")
    assert "concurrency" in side.detail
    assert decision.trace_id == side.trace_id
