"""Activations racing each other, with real concurrency over gRPC."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import grpc

from turnstile_contracts import substrate_pb2
from turnstile_platform.errors import RichError, decode

if TYPE_CHECKING:
    from conftest import Harness, StartService


async def outcome(call: asyncio.Future[substrate_pb2.ActivateResponse]) -> object:
    try:
        return await call
    except grpc.aio.AioRpcError as error:
        return decode(error)


async def test_a_hundred_concurrent_activations_under_a_cap_of_ten_leave_exactly_ten(
    harness: Harness,
) -> None:
    harness.admission.cap = 10
    ids = [f"sb-{n:03}" for n in range(100)]

    results = await asyncio.gather(
        *(outcome(asyncio.ensure_future(harness.activate(i, "acme"))) for i in ids)
    )

    created = {
        r.sandbox.sandbox_id for r in results if isinstance(r, substrate_pb2.ActivateResponse)
    }
    refused = [r for r in results if isinstance(r, RichError)]
    assert len(created) == 10, refused
    assert len(refused) == 90
    assert {(e.code, e.reason) for e in refused} == {
        (grpc.StatusCode.RESOURCE_EXHAUSTED, "CAP_EXCEEDED")
    }
    assert set(harness.processes()) == created
    rows = await harness.rows("SELECT id FROM sandboxes")
    assert {r["id"] for r in rows} == created
    executions = await harness.rows("SELECT sandbox_id FROM executions WHERE ended_at IS NULL")
    assert {r["sandbox_id"] for r in executions} == created
    receipts = await harness.rows("SELECT sandbox_id FROM receipts")
    assert sorted(r["sandbox_id"] for r in receipts) == sorted(created)
    holds = harness.admission.holds.values()
    assert {h.sandbox_id for h in holds if h.state == "committed"} == created
    assert [h for h in holds if h.state == "held"] == []  # no hold left open


async def test_concurrent_activations_of_one_sandbox_create_one_runtime(
    harness: Harness,
) -> None:
    results = await asyncio.gather(*(harness.activate("sb-1", "acme") for _ in range(20)))

    outcomes = sorted(substrate_pb2.Outcome.Name(r.outcome) for r in results)
    assert outcomes == ["OUTCOME_ALREADY_RUNNING"] * 19 + ["OUTCOME_CREATED"]
    assert {r.sandbox.runtime_name for r in results} == {results[0].sandbox.runtime_name}
    assert list(harness.processes()) == ["sb-1"]
    assert len(harness.admission.admits) == 1
    assert len(await harness.rows("SELECT id FROM executions")) == 1


async def test_two_replicas_activating_one_sandbox_create_one_runtime(
    harness: Harness, start_service: StartService
) -> None:
    second = await start_service(harness.database_url)

    results = await asyncio.gather(*(h.activate("sb-1", "acme") for h in [harness, second] * 5))

    created = [r for r in results if r.outcome == substrate_pb2.OUTCOME_CREATED]
    assert len(created) == 1
    assert list(harness.processes()) == ["sb-1"]
    assert len(harness.admission.admits) == 1
