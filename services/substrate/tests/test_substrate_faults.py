"""PostgreSQL failing under the substrate (SPEC X6): a private server the test
stops and restarts; the shared one is never touched."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import asyncpg
import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_contracts import substrate_pb2
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_testing.processes import PostgresProcess, free_port

if TYPE_CHECKING:
    from conftest import Harness, StartService

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def migrated(postgres: PostgresProcess) -> str:
    """Migrate, then CHECKPOINT: the private server commits asynchronously, so a
    crash-stop could otherwise lose the schema it was just given."""
    await asyncio.to_thread(apply_migrations, postgres.url)
    conn = await asyncpg.connect(postgres.url)
    try:
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    return postgres.url


async def health_becomes(harness: Harness, status: int) -> None:
    """Wait on the health Watch stream until the service reports ``status``."""
    stub = health_pb2_grpc.HealthStub(harness.channel)
    call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
    try:
        async with asyncio.timeout(10):
            async for update in call:
                if update.status == status:
                    return
    finally:
        call.cancel()


async def test_postgres_stopped_mid_activation_leaves_no_runtime_and_a_retryable_error(
    private_postgres: PostgresProcess, start_service: StartService
) -> None:
    harness = await start_service(await migrated(private_postgres), database_timeout_s=2.0)
    await health_becomes(harness, SERVING)

    async def stop_postgres() -> None:
        await asyncio.to_thread(private_postgres.stop)

    harness.admission.on_admit = stop_postgres

    error = await harness.error(harness.activate("sb-1", "acme"))

    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason == "DEPENDENCY_UNAVAILABLE"
    assert error.metadata["dependency"] == "postgresql"
    assert error.retryable
    assert harness.processes() == {}  # the runtime it started was stopped
    assert [h.state for h in harness.admission.holds.values()] == ["cancelled"]
    await health_becomes(harness, NOT_SERVING)

    harness.admission.on_admit = None
    await asyncio.to_thread(private_postgres.start)
    await health_becomes(harness, SERVING)

    retried = await harness.activate("sb-1", "acme")

    assert retried.outcome == substrate_pb2.OUTCOME_CREATED
    assert list(harness.processes()) == ["sb-1"]
    rows = await harness.rows("SELECT id, activating_client_id FROM sandboxes")
    assert [tuple(r) for r in rows] == [("sb-1", "acme")]


async def test_postgres_down_before_activation_asks_admission_nothing(
    private_postgres: PostgresProcess, start_service: StartService
) -> None:
    harness = await start_service(await migrated(private_postgres), database_timeout_s=2.0)
    await asyncio.to_thread(private_postgres.stop)

    error = await harness.error(harness.activate("sb-1", "acme"))

    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason == "DEPENDENCY_UNAVAILABLE"
    assert error.retryable
    assert harness.admission.admits == []
    assert harness.processes() == {}


async def test_a_running_sandbox_is_never_refused_even_with_postgres_down(
    private_postgres: PostgresProcess, start_service: StartService
) -> None:
    harness = await start_service(await migrated(private_postgres), database_timeout_s=2.0)
    created = await harness.activate("sb-1", "acme")
    await asyncio.to_thread(private_postgres.stop)

    again = await harness.activate("sb-1", harness.inherit())

    assert again.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING
    assert again.sandbox.runtime_name == created.sandbox.runtime_name
    assert again.charged_client_id == "acme"
    assert len(harness.admission.admits) == 1


async def test_admission_unreachable_is_a_retryable_error_and_creates_nothing(
    migrated_url: str, start_service: StartService
) -> None:
    harness = await start_service(migrated_url, admission_addr=f"127.0.0.1:{free_port()}")

    error = await harness.error(harness.activate("sb-1", harness.native()))

    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason == "DEPENDENCY_UNAVAILABLE"
    assert error.metadata["dependency"] == "admission"
    assert error.retryable
    assert harness.processes() == {}
    assert await harness.rows("SELECT id FROM sandboxes") == []
