"""The schema's migrations (SPEC A2, A5): one idempotent command, a format CHECK
added NOT VALID over rows that violate it, and invariants the database enforces."""

from __future__ import annotations

import asyncio
import os
import shutil
import sys

import asyncpg
import pytest

from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.db.migrate import main as migrate_main

ALL = [
    "0001_sandboxes",
    "0002_executions",
    "0003_receipts",
    "0004_sandboxes_client_check",
    "0005_activation_claims",
]


async def run_command(database_url: str) -> tuple[int, str]:
    """``turnstile-migrate`` as an operator runs it: a process, configured by env."""
    command = shutil.which("turnstile-migrate") or sys.executable
    args = [] if command != sys.executable else ["-m", "turnstile_substrate.db.migrate"]
    proc = await asyncio.create_subprocess_exec(
        command,
        *args,
        env={**os.environ, "TURNSTILE_DATABASE_URL": database_url},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    output, _ = await proc.communicate()
    return await proc.wait(), output.decode()


async def test_the_migrate_command_applies_everything_once_and_is_safe_to_rerun(
    database_url: str,
) -> None:
    code, output = await run_command(database_url)
    assert code == 0, output
    assert f"applied {len(ALL)} migration(s)" in output

    code, output = await run_command(database_url)
    assert code == 0, output
    assert "schema is up to date" in output

    conn = await asyncpg.connect(database_url)
    try:
        tables = {
            r["tablename"]
            for r in await conn.fetch("SELECT tablename FROM pg_tables WHERE schemaname='public'")
        }
    finally:
        await conn.close()
    assert {"sandboxes", "executions", "receipts", "activation_claims"} <= tables


def test_the_migrate_command_fails_cleanly_on_an_unreachable_database() -> None:
    code = migrate_main(["--database-url", "postgresql://postgres@127.0.0.1:1/none"])
    assert code == 1


async def test_the_format_check_is_added_not_valid_over_rows_that_violate_it(
    database_url: str,
) -> None:
    assert (
        await asyncio.to_thread(apply_migrations, database_url, upto="0003_receipts") == (ALL[:3])
    )
    conn = await asyncpg.connect(database_url)
    try:
        bad = ["has space", "x" * 64, "-leading-dash", "ünïcode"]
        for index, value in enumerate(bad):
            await conn.execute(
                "INSERT INTO sandboxes (id, state, substrate, activating_client_id)"
                " VALUES ($1, 'stopped', 'direct', $2)",
                f"old-{index}",
                value,
            )

        assert await asyncio.to_thread(apply_migrations, database_url) == ALL[3:]

        validated = await conn.fetchval(
            "SELECT convalidated FROM pg_constraint"
            " WHERE conname = 'sandboxes_activating_client_id_format'"
        )
        assert validated is False
        assert await conn.fetchval("SELECT count(*) FROM sandboxes") == len(bad)

        for value in bad:
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute(
                    "INSERT INTO sandboxes (id, state, substrate, activating_client_id)"
                    " VALUES ('new', 'running', 'direct', $1)",
                    value,
                )
            with pytest.raises(asyncpg.CheckViolationError):
                await conn.execute(
                    "UPDATE sandboxes SET activating_client_id = $1 WHERE id = 'old-0'", value
                )
        for good in [None, "native", "unattributed", "shared", "acme", "a", "x" * 63, "a.b_c-9"]:
            await conn.execute(
                "INSERT INTO sandboxes (id, state, substrate, activating_client_id)"
                " VALUES ('new', 'running', 'direct', $1)",
                good,
            )
            await conn.execute("DELETE FROM sandboxes WHERE id = 'new'")
    finally:
        await conn.close()


async def test_the_database_allows_one_active_execution_per_sandbox(migrated_url: str) -> None:
    conn = await asyncpg.connect(migrated_url)
    try:
        await conn.execute(
            "INSERT INTO sandboxes (id, state, substrate) VALUES ('sb', 'running', 'direct')"
        )
        insert = (
            "INSERT INTO executions (sandbox_id, substrate, kind, runtime_name)"
            " VALUES ('sb', 'direct', 'cold', $1)"
        )
        await conn.execute(insert, "proc-1")
        with pytest.raises(asyncpg.UniqueViolationError):
            await conn.execute(insert, "proc-2")
        await conn.execute("UPDATE executions SET ended_at = now()")
        await conn.execute(insert, "proc-2")
    finally:
        await conn.close()
