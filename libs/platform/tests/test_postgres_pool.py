"""The bounded PostgreSQL pool (SPEC F7) with a connection the server ended while it sat
idle in the pool: a failover's fast shutdown, ``pg_terminate_backend``, an idle timeout.

The server's last words on such a connection are a FATAL error that nobody asked for;
asyncpg reads it while idle and leaves the connection in its error state, and until the
close arrives too, the next statement on it fails with ``InternalClientError`` ("cannot
switch to state 12; another operation (2) is in progress", MagicStack/asyncpg#1069).
That is an unavailable server, not a bug: it must be UNAVAILABLE, and the connection
discarded rather than handed out again."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest
from asyncpg.pool import PoolConnectionProxy

from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.postgres import (
    BoundedPool,
    create_pool,
    postgres_guard,
)
from turnstile_testing.tcp_proxy import TcpProxy


@pytest.fixture
async def proxied_pool(postgres_url: str) -> AsyncIterator[tuple[BoundedPool, TcpProxy]]:
    """A one-connection bounded pool to the shared server, through a proxy that passes
    the server's words on but not its close."""
    target = urlsplit(postgres_url)
    async with TcpProxy(
        target.hostname or "127.0.0.1", target.port or 5432, pass_closes=False
    ) as proxy:
        pool = await create_pool(
            f"postgresql://{target.username or 'postgres'}@127.0.0.1:{proxy.port}/postgres",
            guard=postgres_guard(2.0),
            min_size=1,
            max_size=1,
            application_name=f"t-{uuid.uuid4().hex[:8]}",
        )
        try:
            yield pool, proxy
        finally:
            pool.terminate()


async def test_a_connection_the_server_ended_while_idle_is_unavailable_and_discarded(
    proxied_pool: tuple[BoundedPool, TcpProxy], postgres_url: str
) -> None:
    pool, proxy = proxied_pool
    async with pool.acquire() as conn:
        pid = await conn.fetchval("SELECT pg_backend_pid()")
    admin = await asyncpg.connect(postgres_url)
    try:
        assert await admin.fetchval("SELECT pg_terminate_backend($1)", pid)
    finally:
        await admin.close()
    await proxy.server_closed.wait()
    # The FATAL message is in the client's socket; let the loop read it (there is no
    # event for "asyncpg has processed bytes already received").
    await asyncio.sleep(0.2)

    async with pool.acquire() as conn:
        with pytest.raises(DependencyUnavailable):  # never an INTERNAL-bound error
            await conn.fetchval("SELECT 1")

    async with pool.acquire() as conn:  # the broken one was discarded: a new connection
        assert await conn.fetchval("SELECT pg_backend_pid()") != pid


async def test_a_transaction_whose_connection_is_gone_is_unavailable(postgres_url: str) -> None:
    """A switchover or crash closes a connection between statements; asyncpg then
    fails the transaction's own COMMIT with ``InterfaceError``, which no statement's
    guard sees. It must reach callers as unavailable (retryable), not INTERNAL."""
    target = urlsplit(postgres_url)
    pool = await create_pool(
        f"postgresql://{target.username or 'postgres'}@{target.hostname}:{target.port}/postgres",
        guard=postgres_guard(2.0),
        min_size=1,
        max_size=1,
        application_name=f"t-{uuid.uuid4().hex[:8]}",
    )

    async def commit_after_the_connection_is_gone(conn: PoolConnectionProxy[Any]) -> None:
        async with conn.transaction():
            await conn.fetchval("SELECT 1")
            conn.terminate()  # gone before the COMMIT

    try:
        async with pool.acquire() as conn:
            with pytest.raises(DependencyUnavailable):
                await commit_after_the_connection_is_gone(conn)
    finally:
        pool.terminate()
