"""Activations racing each other, with real concurrency over gRPC."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import asyncpg
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
    migrated_url: str, start_service: StartService
) -> None:
    # Room for all 19 to join the first (SPEC N2; test_substrate_join has the bound).
    harness = await start_service(migrated_url, activation_waiters_per_flow=32)
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


async def test_activations_waiting_on_admission_hold_no_database_connection(
    migrated_url: str, start_service: StartService
) -> None:
    # One connection in the pool: with a connection held across Admit, the second
    # activation could not even reach admission while the first waits there.
    harness = await start_service(migrated_url, database_pool_max=1, database_pool_min=1)
    sandboxes = [f"sb-{n}" for n in range(4)]
    all_waiting = asyncio.Event()

    async def admit_when_all_are_waiting() -> None:
        if len(harness.admission.admits) == len(sandboxes):
            all_waiting.set()
        await asyncio.wait_for(all_waiting.wait(), 30)

    harness.admission.on_admit = admit_when_all_are_waiting

    results = await asyncio.gather(*(harness.activate(s, "acme") for s in sandboxes))

    assert {r.outcome for r in results} == {substrate_pb2.OUTCOME_CREATED}
    assert set(harness.processes()) == set(sandboxes)


async def test_two_replicas_behind_pgbouncer_in_transaction_mode_create_one_runtime(
    migrated_url: str, pgbouncer_database_url: str, start_service: StartService
) -> None:
    replicas = [
        await start_service(pgbouncer_database_url, database_statement_cache_size=0)
        for _ in range(2)
    ]

    results = await asyncio.gather(*(h.activate("sb-1", "acme") for h in replicas * 5))

    created = [r for r in results if r.outcome == substrate_pb2.OUTCOME_CREATED]
    assert len(created) == 1
    assert {r.sandbox.runtime_name for r in results} == {created[0].sandbox.runtime_name}
    assert list(replicas[0].processes()) == ["sb-1"]
    assert len(replicas[0].admission.admits) == 1
    assert len(await replicas[0].rows("SELECT id FROM executions")) == 1
    assert await replicas[0].rows("SELECT * FROM activation_claims") == []


async def test_a_claim_taken_over_mid_activation_cancels_the_hold_and_leaves_the_runtime(
    harness: Harness,
) -> None:
    async def taken_over_by_an_owner_that_then_dies() -> None:
        harness.admission.on_admit = None
        conn = await asyncpg.connect(harness.database_url)
        try:
            await conn.execute(
                "UPDATE activation_claims SET owner = 'elsewhere/1/x',"
                " expires_at = clock_timestamp() - interval '1 second'"
            )
        finally:
            await conn.close()

    harness.admission.on_admit = taken_over_by_an_owner_that_then_dies

    error = await harness.error(harness.activate("sb-1", "acme"))

    assert (error.code, error.reason) == (grpc.StatusCode.UNAVAILABLE, "SANDBOX_PENDING")
    assert [h.state for h in harness.admission.holds.values()] == ["cancelled"]
    assert await harness.rows("SELECT id FROM executions") == []  # the write was fenced
    runtime = harness.processes()
    assert list(runtime) == ["sb-1"]  # left for the owner that took the sandbox over

    # That owner died too: the next activation takes its lapsed claim and adopts the runtime.
    again = await harness.activate("sb-1", "acme")

    assert again.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING
    assert harness.processes() == runtime
    assert len(await harness.rows("SELECT id FROM executions WHERE ended_at IS NULL")) == 1
    assert len(harness.admission.admits) == 1
