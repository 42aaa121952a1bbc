"""What a bounded pool connection carries back into the pool, and what its release costs.

The pool runs asyncpg's reset query only on a connection marked as holding session
state; every release rolls back an open transaction (asyncpg's own step). Round trips
are counted on the wire: a proxy counts the server's ``ReadyForQuery`` messages."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from urllib.parse import urlsplit

import asyncpg
import pytest
from asyncpg.pool import PoolConnectionProxy

from turnstile_platform.postgres import (
    BoundedPool,
    create_pool,
    mark_session_state,
    postgres_guard,
)
from turnstile_testing.eventually import eventually
from turnstile_testing.pg_wire import ReadyForQueryCounter
from turnstile_testing.tcp_proxy import TcpProxy

Connection = asyncpg.Connection | PoolConnectionProxy


@dataclass
class Counted:
    pool: BoundedPool
    round_trips: ReadyForQueryCounter
    #: A connection of the test's own, outside the pool.
    admin: asyncpg.Connection


@pytest.fixture
async def counted(database_url: str) -> AsyncIterator[Counted]:
    """A one-connection bounded pool to a database of its own (a table ``t`` with the row
    ``id = 1``), through a proxy that counts round trips."""
    admin = await asyncpg.connect(database_url)
    await admin.execute("CREATE TABLE t (id int PRIMARY KEY); INSERT INTO t VALUES (1)")
    counter = ReadyForQueryCounter()
    target = urlsplit(database_url)
    async with TcpProxy(
        target.hostname or "127.0.0.1", target.port or 5432, observe=counter.observer
    ) as proxy:
        pool = await create_pool(
            f"postgresql://{target.username or 'postgres'}@127.0.0.1:{proxy.port}{target.path}",
            guard=postgres_guard(5.0),
            min_size=1,
            max_size=1,
            application_name=f"t-{uuid.uuid4().hex[:8]}",
            ssl=False,  # the proxy reads the protocol
        )
        try:
            yield Counted(pool, counter, admin)
        finally:
            await pool.close()
            await admin.close()


async def row_is_free(admin: asyncpg.Connection) -> bool:
    """Whether another session can lock the row ``t.id = 1`` at once."""
    async with admin.transaction():
        try:
            await admin.execute("SELECT 1 FROM t WHERE id = 1 FOR UPDATE NOWAIT")
        except asyncpg.LockNotAvailableError:
            return False
    return True


async def backend_state(admin: asyncpg.Connection, pid: int) -> str:
    state = await admin.fetchval("SELECT state FROM pg_stat_activity WHERE pid = $1", pid)
    return str(state)


async def test_releasing_an_unmarked_connection_costs_no_round_trip(counted: Counted) -> None:
    async with counted.pool.acquire() as conn:  # prepares the statement once
        await conn.fetchval("SELECT id FROM t WHERE id = $1", 1)
    before = counted.round_trips.count

    for _ in range(10):
        async with counted.pool.acquire() as conn:
            assert await conn.fetchval("SELECT id FROM t WHERE id = $1", 1) == 1

    assert counted.round_trips.count - before == 10


async def until_sleeping(admin: asyncpg.Connection, pid: int) -> None:
    """Return once backend ``pid`` runs its ``pg_sleep``: no client-side event says
    the server got that far, so ask the server."""
    sleeping = "SELECT wait_event = 'PgSleep' FROM pg_stat_activity WHERE pid = $1"

    async def asleep() -> bool:
        return bool(await admin.fetchval(sleeping, pid))

    await eventually(asleep, timeout_s=30, interval_s=0.01, what=f"backend {pid} in pg_sleep")


async def cancel(task: asyncio.Task[None]) -> None:
    """Cancel the caller ``task`` and wait until it has ended cancelled."""
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_a_caller_cancelled_mid_statement_in_a_transaction_returns_a_clean_connection(
    counted: Counted,
) -> None:
    locked = asyncio.Event()
    pid = 0

    async def caller() -> None:
        nonlocal pid
        async with counted.pool.acquire() as conn, conn.transaction():
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            await conn.execute("SELECT 1 FROM t WHERE id = 1 FOR UPDATE")
            locked.set()
            await conn.execute("SELECT pg_sleep(30)")

    task = asyncio.create_task(caller())
    await locked.wait()
    await until_sleeping(counted.admin, pid)
    assert not await row_is_free(counted.admin)
    await cancel(task)

    async with counted.pool.acquire() as conn:
        assert await conn.fetchval("SELECT pg_backend_pid()") == pid  # the same session
        assert not conn.is_in_transaction()
        assert await row_is_free(counted.admin)  # its row lock went with the rollback
    assert await backend_state(counted.admin, pid) == "idle"


async def test_a_caller_cancelled_mid_statement_outside_a_transaction_leaves_nothing_behind(
    counted: Counted,
) -> None:
    """No reset query follows the cancellation now: asyncpg's wait for the server to
    acknowledge the cancel is what keeps the next caller from reading its answer."""
    started = asyncio.Event()
    pid = 0

    async def caller() -> None:
        nonlocal pid
        async with counted.pool.acquire() as conn:
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            started.set()
            await conn.fetchval("SELECT 7 FROM pg_sleep(30)")

    task = asyncio.create_task(caller())
    await started.wait()
    await until_sleeping(counted.admin, pid)
    await cancel(task)

    async with counted.pool.acquire() as conn:
        assert await conn.fetchval("SELECT pg_backend_pid()") == pid
        assert await conn.fetchval("SELECT $1::int", 8) == 8
    assert await backend_state(counted.admin, pid) == "idle"


async def test_a_caller_cancelled_between_statements_of_a_transaction_leaves_nothing(
    counted: Counted,
) -> None:
    locked = asyncio.Event()
    pid = 0

    async def caller() -> None:
        nonlocal pid
        async with counted.pool.acquire() as conn, conn.transaction():
            pid = await conn.fetchval("SELECT pg_backend_pid()")
            await conn.execute("SELECT 1 FROM t WHERE id = 1 FOR UPDATE")
            await conn.execute("UPDATE t SET id = 2 WHERE id = 1")
            locked.set()
            await asyncio.Event().wait()  # a remote call that never answers

    task = asyncio.create_task(caller())
    await locked.wait()
    await cancel(task)

    async with counted.pool.acquire() as conn:
        assert await conn.fetchval("SELECT pg_backend_pid()") == pid
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT count(*) FROM t WHERE id = 1") == 1  # not written
    assert await row_is_free(counted.admin)


async def test_a_transaction_begun_by_hand_and_left_open_is_rolled_back_on_release(
    counted: Counted,
) -> None:
    async with counted.pool.acquire() as conn:
        await conn.execute("BEGIN")
        await conn.execute("UPDATE t SET id = 2 WHERE id = 1")
    async with counted.pool.acquire() as conn:
        assert not conn.is_in_transaction()
        assert await conn.fetchval("SELECT count(*) FROM t WHERE id = 1") == 1


async def take_session_state(conn: Connection) -> int:
    """Leave every kind of session state on ``conn``'s session; returns its backend pid."""
    pid: int = await conn.fetchval("SELECT pg_backend_pid()")
    await conn.execute("SELECT pg_advisory_lock(42)")
    await conn.execute("SET statement_timeout = '17s'")
    await conn.execute("BEGIN; DECLARE held CURSOR WITH HOLD FOR SELECT 1; COMMIT")
    await conn.execute("LISTEN events")
    return pid


async def session_state(conn: Connection, admin: asyncpg.Connection) -> dict[str, object]:
    """What of :func:`take_session_state`'s state ``conn``'s session still holds."""
    pid = await conn.fetchval("SELECT pg_backend_pid()")
    return {
        "advisory locks": await admin.fetchval(
            "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND pid = $1", pid
        ),
        "statement_timeout": await conn.fetchval("SHOW statement_timeout"),
        "held cursors": await conn.fetchval("SELECT count(*) FROM pg_cursors WHERE name = 'held'"),
        "channels": await conn.fetchval("SELECT count(*) FROM pg_listening_channels()"),
    }


CLEAN = {"advisory locks": 0, "statement_timeout": "0", "held cursors": 0, "channels": 0}


async def test_marked_session_state_is_reset_on_release(counted: Counted) -> None:
    async with counted.pool.acquire() as conn:
        pid = await take_session_state(conn)
        mark_session_state(conn)
        before = counted.round_trips.count
    assert counted.round_trips.count - before == 1  # the release ran the reset query

    async with counted.pool.acquire() as conn:
        assert await conn.fetchval("SELECT pg_backend_pid()") == pid  # the same session
        assert await session_state(conn, counted.admin) == CLEAN
        before = counted.round_trips.count
    assert counted.round_trips.count == before  # reset once: the mark went with it


async def test_unmarked_session_state_survives_release(counted: Counted) -> None:
    """The contract, shown: state taken without the mark reaches the next caller."""
    async with counted.pool.acquire() as conn:
        await take_session_state(conn)
    async with counted.pool.acquire() as conn:
        state = await session_state(conn, counted.admin)
    assert state == {
        "advisory locks": 1,
        "statement_timeout": "17s",
        "held cursors": 1,
        "channels": 1,
    }


async def test_add_listener_marks_the_connection_itself(counted: Counted) -> None:
    conn = await counted.pool.acquire()
    await conn.add_listener("events", lambda *args: None)
    before = counted.round_trips.count
    # asyncpg warns when a connection with a listener goes back to a pool.
    with pytest.warns(asyncpg.InterfaceWarning, match="notification listener"):
        await counted.pool.release(conn)
    assert counted.round_trips.count - before == 1  # the reset query

    async with counted.pool.acquire() as conn:
        assert await conn.fetchval("SELECT count(*) FROM pg_listening_channels()") == 0
