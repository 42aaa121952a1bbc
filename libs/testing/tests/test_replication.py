"""The test kit's primary + streaming standby is a real replica set: the standby
streams and refuses writes, a multi-host URL finds the primary, and after a
switchover (fast stop, promote) the same URL finds the promoted standby with every
committed row."""

from __future__ import annotations

import asyncio

import asyncpg
import pytest

from turnstile_testing.replication import PostgresPair


async def _wait_replayed(pair: PostgresPair, rows: int) -> None:
    """Until the standby shows ``rows`` rows (replication is asynchronous: polled)."""
    async with asyncio.timeout(30):
        while True:
            conn = await asyncpg.connect(pair.second.url)
            try:
                if await conn.fetchval("SELECT count(*) FROM kit_rows") == rows:
                    return
            except asyncpg.UndefinedTableError:
                pass  # the CREATE has not been replayed yet
            finally:
                await conn.close()
            await asyncio.sleep(0.05)


async def test_a_multi_host_url_follows_the_primary_across_a_switchover(
    postgres_pair: PostgresPair,
) -> None:
    conn = await asyncpg.connect(postgres_pair.url)
    try:
        assert await conn.fetchval("SELECT pg_is_in_recovery()") is False
        assert await conn.fetchval("SHOW port") == str(postgres_pair.first.port)
        await conn.execute("CREATE TABLE kit_rows (n int)")
        await conn.execute("INSERT INTO kit_rows SELECT generate_series(1, 100)")
    finally:
        await conn.close()
    await _wait_replayed(postgres_pair, 100)
    standby = await asyncpg.connect(postgres_pair.second.url)
    try:
        assert await standby.fetchval("SELECT pg_is_in_recovery()") is True
        with pytest.raises(asyncpg.ReadOnlySQLTransactionError):
            await standby.execute("INSERT INTO kit_rows VALUES (0)")
    finally:
        await standby.close()
    # committed on the primary just before the switch, never waited for on the standby
    conn = await asyncpg.connect(postgres_pair.url)
    try:
        await conn.execute("INSERT INTO kit_rows SELECT generate_series(101, 200)")
    finally:
        await conn.close()

    took = await asyncio.to_thread(postgres_pair.switchover)

    assert 0 < took.total_s == took.stop_s + took.promote_s
    conn = await asyncpg.connect(postgres_pair.url)
    try:
        assert await conn.fetchval("SHOW port") == str(postgres_pair.second.port)
        assert await conn.fetchval("SELECT pg_is_in_recovery()") is False
        assert await conn.fetchval("SELECT count(*) FROM kit_rows") == 200  # nothing lost
        await conn.execute("INSERT INTO kit_rows VALUES (201)")
    finally:
        await conn.close()
