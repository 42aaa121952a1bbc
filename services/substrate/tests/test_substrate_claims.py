"""Activation claims (``turnstile_substrate.locks.SandboxClaims``, ``db/claims.py``): one owner
of a sandbox at a time across replicas, an expiry for a dead owner, renewal while an
activation runs (bounded), and fencing of a claim that lapsed and was taken over — against
real PostgreSQL, and through a real PgBouncer in transaction mode."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from datetime import timedelta

import asyncpg
import pytest

from turnstile_substrate.claim_sweep import CHUNK, StaleClaimSweep
from turnstile_substrate.db import claims, records
from turnstile_substrate.db.claims import Claim, ClaimLostError
from turnstile_substrate.locks import LockTimeoutError, SandboxClaims
from turnstile_substrate.runtime import CreateKind, Runtime

RUNTIME = Runtime("sb-1", "ts-sb-1-0", CreateKind.COLD, "acme", "default")

Pools = Callable[[], AbstractAsyncContextManager[asyncpg.Pool]]


@pytest.fixture(params=["postgresql", "pgbouncer"])
async def pools(request: pytest.FixtureRequest, migrated_url: str) -> Pools:
    """Pools (one per replica) on a migrated database: straight to PostgreSQL, or through
    PgBouncer in transaction mode with asyncpg's statement cache off, as documented."""
    url, cache = migrated_url, 100
    if request.param == "pgbouncer":
        url, cache = request.getfixturevalue("pgbouncer").url(migrated_url), 0

    @asynccontextmanager
    async def pool() -> AsyncIterator[asyncpg.Pool]:
        created = await asyncpg.create_pool(url, min_size=1, max_size=2, statement_cache_size=cache)
        try:
            yield created
        finally:
            await created.close()

    return pool


@pytest.fixture
async def conn(migrated_url: str) -> AsyncIterator[asyncpg.Connection]:
    connection = await asyncpg.connect(migrated_url)
    try:
        yield connection
    finally:
        await connection.close()


async def lapse(conn: asyncpg.Connection, sandbox_id: str) -> None:
    """What a dead owner's claim becomes: its expiry passes (no renewal)."""
    await conn.execute(
        "UPDATE activation_claims SET expires_at = clock_timestamp() - interval '1 second'"
        " WHERE sandbox_id = $1",
        sandbox_id,
    )


async def test_concurrent_replicas_hold_a_sandboxes_claim_one_at_a_time(pools: Pools) -> None:
    replicas, rounds = 6, 5
    holders, most, entered = 0, 0, 0

    async def replica(index: int) -> None:
        nonlocal holders, most, entered
        async with pools() as pool:
            sandbox_claims = SandboxClaims(
                pool, ttl_s=10, max_s=60, database_timeout_s=5, instance=f"replica-{index}"
            )
            for _ in range(rounds):
                async with sandbox_claims.hold("sb-1", timeout_s=60):
                    holders += 1
                    entered += 1
                    most = max(most, holders)
                    async with pool.acquire() as conn:  # a statement while holding it
                        await conn.fetchval("SELECT count(*) FROM activation_claims")
                    holders -= 1

    await asyncio.gather(*(replica(i) for i in range(replicas)))

    assert entered == replicas * rounds
    assert most == 1
    async with pools() as pool, pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM activation_claims") == 0


async def test_a_claim_excludes_another_owner_and_a_retry_by_its_own_owner_succeeds(
    conn: asyncpg.Connection,
) -> None:
    first, second = Claim("sb-1", "a/1/x"), Claim("sb-1", "b/1/y")

    assert await claims.try_claim(conn, first, 10)
    assert not await claims.try_claim(conn, second, 10)
    assert await claims.try_claim(conn, first, 10)  # the answer was lost: ask again
    assert await claims.in_progress(conn, "sb-1")


async def test_a_lapsed_claim_is_taken_over_and_fences_the_first_owners_writes(
    conn: asyncpg.Connection,
) -> None:
    dead, next_owner = Claim("sb-1", "a/1/x"), Claim("sb-1", "b/1/y")
    assert await claims.try_claim(conn, dead, 10)
    await lapse(conn, "sb-1")

    assert await claims.try_claim(conn, next_owner, 10)
    assert not await claims.renew(conn, dead, 10)
    with pytest.raises(ClaimLostError):
        await records.record_activation(
            conn, RUNTIME, substrate="kubernetes", charged_key="acme", receipt=None, claim=dead
        )
    assert await conn.fetchval("SELECT count(*) FROM sandboxes") == 0  # nothing written

    await records.record_activation(
        conn, RUNTIME, substrate="kubernetes", charged_key="acme", receipt=None, claim=next_owner
    )
    with pytest.raises(ClaimLostError):
        await records.end_execution(conn, "sb-1", reason="deactivated", claim=dead)
    assert await records.runtime_is_recorded(conn, "sb-1", RUNTIME.name)

    await claims.release(conn, dead)  # not its claim any more: a no-op
    assert await claims.in_progress(conn, "sb-1")


async def test_a_lapsed_claim_nobody_took_still_lets_its_owner_write(
    conn: asyncpg.Connection,
) -> None:
    claim = Claim("sb-1", "a/1/x")
    assert await claims.try_claim(conn, claim, 10)
    await lapse(conn, "sb-1")

    record = await records.record_activation(
        conn, RUNTIME, substrate="kubernetes", charged_key="acme", receipt=None, claim=claim
    )

    assert record.execution is not None
    assert record.execution.runtime_name == RUNTIME.name


async def _db_time_passes(conn: asyncpg.Connection, instant: object) -> None:
    """Let the database's clock pass ``instant``: a claim's expiry is that clock, and
    nothing announces it, so time itself must pass."""
    remaining = await conn.fetchval(
        "SELECT extract(epoch FROM $1::timestamptz - clock_timestamp())::float8", instant
    )
    await asyncio.sleep(max(0.0, remaining) + 0.01)


async def test_an_activation_that_outlasts_the_ttl_keeps_its_claim_by_renewing_it(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    sandbox_claims = SandboxClaims(pool, ttl_s=0.3, max_s=60, database_timeout_s=5)
    async with sandbox_claims.hold("sb-1", timeout_s=5) as claim:
        first_expiry = await conn.fetchval(
            "SELECT expires_at FROM activation_claims WHERE sandbox_id = 'sb-1'"
        )
        await _db_time_passes(conn, first_expiry + timedelta(seconds=0.6))  # two TTLs on

        assert not await claims.try_claim(conn, Claim("sb-1", "other/1/z"), 10)
        assert await conn.fetchval("SELECT owner FROM activation_claims") == claim.owner
    assert await conn.fetchval("SELECT count(*) FROM activation_claims") == 0  # released


async def test_renewal_stops_after_the_maximum_so_a_stuck_activation_loses_its_sandbox(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    sandbox_claims = SandboxClaims(pool, ttl_s=0.3, max_s=0.3, database_timeout_s=5)
    async with sandbox_claims.hold("sb-1", timeout_s=5) as stuck:
        other = SandboxClaims(pool, ttl_s=10, max_s=60, database_timeout_s=5)
        async with other.hold("sb-1", timeout_s=10) as next_owner:
            with pytest.raises(ClaimLostError):
                await records.record_activation(
                    conn,
                    RUNTIME,
                    substrate="kubernetes",
                    charged_key="acme",
                    receipt=None,
                    claim=stuck,
                )
            assert await conn.fetchval("SELECT owner FROM activation_claims") == next_owner.owner


async def test_waiting_for_a_claim_held_elsewhere_gives_up_at_the_timeout(
    pool: asyncpg.Pool, conn: asyncpg.Connection
) -> None:
    assert await claims.try_claim(conn, Claim("sb-1", "elsewhere/1/x"), 60)
    sandbox_claims = SandboxClaims(pool, ttl_s=10, max_s=60, database_timeout_s=5)
    with pytest.raises(LockTimeoutError):
        async with sandbox_claims.hold("sb-1", timeout_s=0.3):
            raise AssertionError("took a claim another owner holds")
    assert await conn.fetchval("SELECT owner FROM activation_claims") == "elsewhere/1/x"


async def _claim_expired_for(conn: asyncpg.Connection, sandbox_id: str, seconds: float) -> None:
    await conn.execute(
        "INSERT INTO activation_claims (sandbox_id, owner, expires_at)"
        " VALUES ($1, 'dead-replica/1/x', clock_timestamp() - make_interval(secs => $2))",
        sandbox_id,
        seconds,
    )


async def _claimed(conn: asyncpg.Connection) -> set[str]:
    rows = await conn.fetch("SELECT sandbox_id FROM activation_claims")
    return {row["sandbox_id"] for row in rows}


async def test_the_leader_deletes_claims_dead_owners_left_and_nothing_younger(
    pools: Pools, conn: asyncpg.Connection
) -> None:
    await _claim_expired_for(conn, "long-dead", 3600)
    await _claim_expired_for(conn, "just-lapsed", 1)  # a takeover may still fence it
    async with pools() as pool:
        live = SandboxClaims(pool, ttl_s=10, max_s=60, database_timeout_s=5)
        sweep = StaleClaimSweep(pool, expired_for_s=120, interval_s=120, database_timeout_s=5)
        async with live.hold("in-progress", timeout_s=5):
            assert await sweep.sweep_once() == 1
            assert await _claimed(conn) == {"just-lapsed", "in-progress"}
            assert await sweep.sweep_once() == 0


async def test_a_backlog_of_stale_claims_goes_in_chunks_and_skips_a_fenced_row(
    migrated_url: str, conn: asyncpg.Connection
) -> None:
    await conn.execute(
        "INSERT INTO activation_claims (sandbox_id, owner, expires_at)"
        " SELECT 'sb-' || i, 'dead-replica/1/x', clock_timestamp() - interval '1 hour'"
        " FROM generate_series(1, $1) AS i",
        2 * CHUNK + 7,
    )
    # A final transaction fencing one of them holds its row lock meanwhile.
    fencer = await asyncpg.connect(migrated_url)
    try:
        async with fencer.transaction():
            await claims.fence(fencer, Claim("sb-1", "dead-replica/1/x"))
            pool = await asyncpg.create_pool(migrated_url, min_size=1, max_size=1)
            try:
                sweep = StaleClaimSweep(
                    pool, expired_for_s=120, interval_s=120, database_timeout_s=5
                )
                assert await sweep.sweep_once() == 2 * CHUNK + 6
            finally:
                await pool.close()
    finally:
        await fencer.close()
    assert await _claimed(conn) == {"sb-1"}
