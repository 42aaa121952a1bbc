"""What the pool hands out is connected (redis-py's checks, with the reconnect wrapper
skipped for a connection that is connected and clean), and a connection Redis closed
does not fail the next call."""

from __future__ import annotations

import os

import redis.asyncio as aioredis

from turnstile_platform.redis_bounded import UncontendedPool
from turnstile_platform.redis_client import create_redis

REDIS_URL = os.environ.get("TURNSTILE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


async def test_a_disconnected_connection_is_connected_when_handed_out() -> None:
    pool = UncontendedPool.from_url(REDIS_URL, max_connections=1)
    try:
        connection = await pool.get_connection()
        await pool.release(connection)
        await connection.disconnect()
        again = await pool.get_connection()
        assert again is connection
        assert again.is_connected
        await again.send_command("ECHO", "again")
        assert await again.read_response() == b"again"
        await pool.release(again)
        assert await pool.get_connection() is connection  # connected and clean: as it is
    finally:
        await pool.disconnect()


async def test_a_connection_redis_closed_does_not_fail_the_next_call() -> None:
    client = create_redis(REDIS_URL, timeout_s=2.0, max_connections=1)
    admin = aioredis.Redis.from_url(REDIS_URL)
    try:
        first_id = await client.client_id()
        await admin.client_kill_filter(_id=str(first_id))
        assert await client.echo("after") == b"after"
        assert await client.client_id() != first_id
    finally:
        await client.aclose()
        await admin.aclose()
