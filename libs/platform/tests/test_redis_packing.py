"""Commands are packed by hiredis (C), byte for byte as redis-py's Python packer
packs them, and round-trip through a real Redis: the fast path changes nothing a
caller can see."""

from __future__ import annotations

import pytest
from redis.asyncio.connection import Connection
from redis.exceptions import DataError
from redis.typing import EncodableT

from turnstile_platform.redis_bounded import BoundedRedis, BoundedScript
from turnstile_platform.redis_client import create_redis
from turnstile_platform.redis_cluster import BoundedRedisCluster
from turnstile_platform.redis_internals import pack_command
from turnstile_testing.processes import RedisProcess

ADMIT_LIKE = (
    "EVALSHA",
    "f" * 40,
    3,
    b"t:{adm}:pending:acme",
    "t:{adm}:live:acme",
    memoryview(b"t:{adm}:bucket"),
    7,
    0.25,
    -1,
    10**20,
    "ünïcode",
    b"\x00\xffbinary",
    "",
)


@pytest.mark.parametrize(
    "args",
    [
        ADMIT_LIKE,
        ("CONFIG GET", "maxmemory"),  # a command name with a space is split, as redis-py does
        (b"CLIENT SETNAME", b"x"),
        ("PING",),
        ("SET", "k", b"v" * 10_000),  # redis-py chunks large values; the bytes are the same
    ],
)
def test_packing_matches_redis_py_byte_for_byte(args: tuple[EncodableT, ...]) -> None:
    python_packed = b"".join(bytes(part) for part in Connection().pack_command(*args))
    assert b"".join(pack_command(*args)) == python_packed


@pytest.mark.parametrize("bad", [None, True, object()])
def test_what_redis_py_refuses_is_refused_as_its_data_error(bad: object) -> None:
    with pytest.raises(DataError):
        Connection().pack_command("SET", "k", bad)  # type: ignore[arg-type]
    with pytest.raises(DataError):
        pack_command("SET", "k", bad)


async def test_commands_scripts_and_pipelines_round_trip_through_a_real_redis(
    redis_url: str, redis_prefix: str, redis_topology: str
) -> None:
    client = create_redis(redis_url, timeout_s=2.0)
    key = f"{redis_prefix}packed"
    try:
        if redis_topology == "cluster":
            # redis-py's cluster nodes make their own connections, packed by its
            # Python packer: the round trip below is all there is to check there.
            assert isinstance(client, BoundedRedisCluster)
        else:  # one server, or Sentinel's primary: the pool's connections use it
            assert isinstance(client, BoundedRedis)
            connection = await client.connection_pool.get_connection()
            assert connection.pack_command is pack_command
            await client.connection_pool.release(connection)
        await client.set(key, "ünïcode\x00")
        assert await client.get(key) == "ünïcode\x00".encode()
        script = client.register_script("return {KEYS[1], ARGV[1], ARGV[2]}")
        assert await script(keys=[key], args=[7, b"\xff"]) == [key.encode(), b"7", b"\xff"]
        async with client.pipeline(transaction=True) as pipe:
            pipe.incrby(key + ":n", 5)
            pipe.get(key + ":n")
            assert await pipe.execute() == [5, b"5"]
        with pytest.raises(DataError):
            await client.set(key, None)  # type: ignore[arg-type]
    finally:
        await client.delete(key, key + ":n")
        await client.aclose()


async def test_a_script_is_one_evalsha_and_reloads_itself_after_noscript() -> None:
    """The lean script call (``BoundedScript``) sends one EVALSHA per call, and a
    Redis that lost its scripts (SCRIPT FLUSH, as after a restart or a failover)
    gets the script loaded again and the call answered, as redis-py's does. A
    private server: flushing the shared one's scripts would touch other tests."""
    server = RedisProcess().start()
    client = create_redis(server.url, timeout_s=2.0)
    try:
        script = client.register_script("return {#KEYS, #ARGV, KEYS[1], ARGV[1]}")
        assert isinstance(script, BoundedScript)
        await client.script_load(script.script)
        await client.config_resetstat()
        assert await script(keys=["k"], args=[7]) == [1, 1, b"k", b"7"]
        assert await script() == [0, 0]
        stats = await client.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 2
        await client.script_flush()
        assert await script(keys=["k", "j"], args=["x", b"y"]) == [2, 2, b"k", b"x"]
        stats = await client.info("commandstats")
        assert stats["cmdstat_evalsha"]["calls"] == 4  # NOSCRIPT, then the call again
        assert stats["cmdstat_script|load"]["calls"] == 1
        async with client.pipeline(transaction=False) as pipe:  # redis-py's own path
            await script(keys=["p"], args=[1], client=pipe)
            assert await pipe.execute() == [[1, 1, b"p", b"1"]]
    finally:
        await client.aclose()
        server.close()
