"""PostgreSQL hung, killed, read-only or behind a multi-host URL (SPEC F3, F7).

A paused PostgreSQL (every process SIGSTOPped: connections accept, nothing
answers) costs ``Activate`` its database budget and no more: UNAVAILABLE with a
retry hint, and once the breaker opens, at once. A read-only server is
UNAVAILABLE too, never INTERNAL; a multi-host URL with
``target_session_attrs=read-write`` skips a host that is down or read-only."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

import asyncpg
import grpc

from turnstile_contracts import substrate_pb2
from turnstile_platform import health_check
from turnstile_platform.errors import RichError
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_testing.processes import PostgresProcess, free_port

if TYPE_CHECKING:
    from conftest import Harness, StartService

BUDGET_S = 0.5
#: Slack for a loaded 2-core machine on top of the budget.
MARGIN_S = 0.75
#: The activation claim's ttl in the paused-server test (see there).
CLAIM_TTL_S = 2.0


async def migrated(postgres: PostgresProcess, database: str = "postgres") -> str:
    url = postgres.url.rsplit("/", 1)[0] + f"/{database}"
    await asyncio.to_thread(apply_migrations, url)
    conn = await asyncpg.connect(url)
    try:
        await conn.execute("CHECKPOINT")
    finally:
        await conn.close()
    return url


async def timed_error(harness: Harness, call: Awaitable[object]) -> tuple[float, RichError]:
    started = time.perf_counter()
    error = await harness.error(call)
    return time.perf_counter() - started, error


def assert_postgres_unavailable(error: RichError) -> None:
    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason == "DEPENDENCY_UNAVAILABLE"
    assert error.metadata["dependency"] == "postgresql"
    assert error.retryable


async def test_activate_answers_within_the_budget_while_postgres_is_paused(
    private_postgres: PostgresProcess, start_service: StartService
) -> None:
    # The first paused call's claim statement waits in the server's socket and is
    # committed when it resumes; that claim then blocks sb-1's retry below until it
    # expires (correctly: its owner may still be working). A short claim ttl keeps
    # that wait to seconds, not the default 10 s.
    harness = await start_service(
        await migrated(private_postgres),
        database_timeout_s=BUDGET_S,
        breaker_failures=3,
        activation_claim_ttl_s=CLAIM_TTL_S,
    )
    assert await health_check.wait_serving(harness.app.address, timeout_s=10)
    await harness.activate("sb-0", "acme")

    await asyncio.to_thread(private_postgres.pause)
    try:
        seconds = []
        for i in range(6):  # three spend the budget and open the breaker; three fail at once
            elapsed, error = await timed_error(harness, harness.activate(f"sb-{i + 1}", "acme"))
            assert_postgres_unavailable(error)
            seconds.append(elapsed)
        print(f"\nActivate on a paused PostgreSQL: {[round(s * 1000) for s in seconds]} ms")
        assert max(seconds) < BUDGET_S + MARGIN_S
        assert len(harness.admission.admits) == 1  # sb-0 only: nothing else reached admission
        assert list(harness.processes()) == ["sb-0"]
        assert await health_check.check(harness.app.address) == "NOT_SERVING"
    finally:
        await asyncio.to_thread(private_postgres.resume)

    # The health check's statement is the probe; after it the first call is normal.
    assert await health_check.wait_serving(harness.app.address, timeout_s=10)
    created = await harness.activate("sb-1", "acme")
    assert created.outcome == substrate_pb2.OUTCOME_CREATED


async def test_activate_answers_within_the_budget_when_postgres_is_killed(
    private_postgres: PostgresProcess, start_service: StartService
) -> None:
    harness = await start_service(await migrated(private_postgres), database_timeout_s=BUDGET_S)
    await harness.activate("sb-0", "acme")
    await asyncio.to_thread(private_postgres.stop)
    for i in range(4):
        elapsed, error = await timed_error(harness, harness.activate(f"sb-{i + 1}", "acme"))
        assert_postgres_unavailable(error)
        assert elapsed < BUDGET_S + MARGIN_S


async def read_only_copy(private_postgres: PostgresProcess, database: str) -> str:
    """The private server with the same database, migrated, then made read-only."""
    admin = await asyncpg.connect(private_postgres.url)
    try:
        await admin.execute(f'CREATE DATABASE "{database}"')
    finally:
        await admin.close()
    url = await migrated(private_postgres, database)
    admin = await asyncpg.connect(private_postgres.url)
    try:
        await admin.execute("ALTER SYSTEM SET default_transaction_read_only = on")
        await admin.execute("SELECT pg_reload_conf()")
    finally:
        await admin.close()
    return url


async def test_a_read_only_server_is_unavailable_not_internal(
    private_postgres: PostgresProcess, start_service: StartService, migrated_url: str
) -> None:
    database = urlsplit(migrated_url).path.lstrip("/")
    url = await read_only_copy(private_postgres, database)
    harness = await start_service(url, database_timeout_s=BUDGET_S)

    error = await harness.error(harness.activate("sb-1", "acme"))

    assert_postgres_unavailable(error)
    assert harness.processes() == {}
    # The read-only server refuses the activation's claim, before admission is asked.
    assert harness.admission.admits == []


async def test_a_multi_host_url_picks_the_read_write_host(
    private_postgres: PostgresProcess, start_service: StartService, migrated_url: str
) -> None:
    shared = urlsplit(migrated_url)
    database = shared.path.lstrip("/")
    await read_only_copy(private_postgres, database)
    hosts = (
        f"127.0.0.1:{free_port()},127.0.0.1:{private_postgres.port},{shared.netloc.split('@')[-1]}"
    )
    url = f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"
    harness = await start_service(url, database_timeout_s=5.0)

    created = await harness.activate("sb-1", "acme")

    assert created.outcome == substrate_pb2.OUTCOME_CREATED
    rows = await harness.rows("SELECT id, activating_client_id FROM sandboxes")
    assert [tuple(r) for r in rows] == [("sb-1", "acme")]
