"""``_decision_stream.lua``'s ``log_append`` alone against real Redis (SPEC N3): each
stream keeps its own bounds (one stream's flood trims no other), a sandbox's
entries are copied under the same ids into its bounded stream, the sandbox
streams per stream are bounded (the least recent one goes), and every stream is
listed in the log's index."""

from __future__ import annotations

from typing import Any

from turnstile_platform.decision_log import key_stream, sandbox_stream, streams_index
from turnstile_platform.redis_client import read_script

NODE = 100  # stream-node-max-entries: '~' trims whole nodes

APPEND = "\n".join(
    [
        read_script("turnstile_platform", "_decision_stream.lua"),
        "local bounds = {tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]),"
        " tonumber(ARGV[4])}",
        "return log_append(KEYS[1], KEYS[2], ARGV[5], bounds, {'kind', ARGV[6]})",
    ]
)


async def append(
    redis: Any,
    prefix: str,
    stream: str,
    sandbox: str = "",
    *,
    max_entries: int = 1000,
    sb_max: int = 10,
    sb_keep: int = 3,
    kind: str = "refused",
) -> bytes:
    keys = [stream, streams_index(prefix)]
    result: bytes = await redis.eval(
        APPEND, 2, *keys, max_entries, 60_000, sb_max, sb_keep, sandbox, kind
    )
    return result


async def test_a_flood_of_one_key_trims_only_its_own_stream(redis: Any, redis_prefix: str) -> None:
    acme, globex = key_stream(redis_prefix, "acme"), key_stream(redis_prefix, "globex")
    for n in range(5):
        await append(redis, redis_prefix, globex, f"gx-{n}", max_entries=150, kind="admitted")
    for _ in range(1000):
        await append(redis, redis_prefix, acme, "acme--x", max_entries=150)
    assert 150 <= await redis.xlen(acme) < 150 + NODE
    assert [f[b"kind"] for _, f in await redis.xrange(globex)] == [b"admitted"] * 5


async def test_a_sandboxs_entries_are_copied_under_the_same_ids_within_its_bound(
    redis: Any, redis_prefix: str
) -> None:
    acme = key_stream(redis_prefix, "acme")
    ids = [await append(redis, redis_prefix, acme, "sb-1", sb_max=10) for _ in range(300)]
    await append(redis, redis_prefix, acme, "sb-2")
    copy = await redis.xrange(sandbox_stream(acme, "sb-1"))
    assert 10 <= len(copy) < 10 + NODE
    assert [entry_id for entry_id, _ in copy] == ids[-len(copy) :]
    assert 60_000 < await redis.pttl(sandbox_stream(acme, "sb-1")) <= 61_000
    # An entry without a sandbox has no copy.
    await append(redis, redis_prefix, acme, "")
    assert await redis.zcard(f"{acme}:sbs") == 2


async def test_past_its_bound_of_sandboxes_a_stream_drops_the_least_recent_ones(
    redis: Any, redis_prefix: str
) -> None:
    acme = key_stream(redis_prefix, "acme")
    for sandbox in ("sb-1", "sb-2", "sb-3", "sb-1", "sb-4"):
        await append(redis, redis_prefix, acme, sandbox, sb_keep=3)
    # sb-2 was the least recently logged when sb-4 came: its copy is gone, its
    # entries stay in the key's stream.
    assert not await redis.exists(sandbox_stream(acme, "sb-2"))
    members = await redis.zrange(f"{acme}:sbs", 0, -1)
    assert sorted(members) == [b"sb-1", b"sb-3", b"sb-4"]
    assert await redis.xlen(acme) == 5


async def test_a_sandbox_stream_ahead_of_its_key_takes_its_own_next_id(
    redis: Any, redis_prefix: str
) -> None:
    """A clock that went back across a failover: the key's new id is older than
    the sandbox stream's newest, so the copy takes an id of its own rather than
    failing the decision's script."""
    acme = key_stream(redis_prefix, "acme")
    await redis.xadd(sandbox_stream(acme, "sb-1"), {"kind": "future"}, id="99999999999999-0")
    entry_id = await append(redis, redis_prefix, acme, "sb-1")
    copy = await redis.xrange(sandbox_stream(acme, "sb-1"))
    assert [f[b"kind"] for _, f in copy] == [b"future", b"refused"]
    assert copy[-1][0] != entry_id


async def test_every_stream_is_listed_in_the_index_and_expires_with_it(
    redis: Any, redis_prefix: str
) -> None:
    acme, globex = key_stream(redis_prefix, "acme"), key_stream(redis_prefix, "globex")
    await append(redis, redis_prefix, acme, "sb-1")
    await append(redis, redis_prefix, globex)
    index = streams_index(redis_prefix)
    assert sorted(await redis.zrange(index, 0, -1)) == [acme.encode(), globex.encode()]
    assert await redis.pttl(index) > 60_000
    # A sandbox stream is not a stream of the index (the export ships each entry
    # once, from its key's stream).
    assert sandbox_stream(acme, "sb-1").encode() not in await redis.zrange(index, 0, -1)


async def test_zero_entries_writes_nothing(redis: Any, redis_prefix: str) -> None:
    acme = key_stream(redis_prefix, "acme")
    assert await append(redis, redis_prefix, acme, "sb-1", max_entries=0) is None
    assert [k async for k in redis.scan_iter(match=f"{redis_prefix}*")] == []
