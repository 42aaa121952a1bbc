"""``decision_append.lua``, :class:`DecisionLogWriter` and :func:`append_platform_entry`
against real Redis (SPEC Q3, N3): a batch is appended in order with one field list,
each entry to its own stream within that stream's bounds; a client id whose key
admission never logged goes to the shared key's stream, no client to the
platform's; nothing is written with the log off."""

from __future__ import annotations

from typing import Any

from turnstile_platform.decision_log import (
    FIELDS,
    DecisionLogWriter,
    append_platform_entry,
    key_stream,
    platform_stream,
    sandbox_stream,
    script_text,
    streams_index,
)
from turnstile_platform.settings import DecisionLogSettings

SCRIPT = script_text("decision_append.lua")
NODE = 100  # stream-node-max-entries: '~' trims whole nodes


async def append(
    redis: Any, prefix: str, stream: str, max_entries: int, kinds: list[str], instead: str = ""
) -> list[bytes]:
    args: list[Any] = [max_entries, 60_000, 0, 1, 2]
    for kind in kinds:
        args += [stream, instead, "", "kind", kind, "service", "test"]
    keys = [streams_index(prefix), platform_stream(prefix)]
    return list(await redis.eval(SCRIPT, 2, *keys, *args))


async def test_a_batch_is_appended_in_order_within_its_bounds(
    redis: Any, redis_prefix: str
) -> None:
    key = key_stream(redis_prefix, "acme")
    ids = await append(redis, redis_prefix, key, 1000, ["a", "b", "c"])
    entries = await redis.xrange(key)
    assert [f[b"kind"] for _, f in entries] == [b"a", b"b", b"c"]
    assert ids == [entry_id for entry_id, _ in entries]
    # Expires a trim period (1 s) past max age, as admission's appends leave it.
    assert 60_000 < await redis.pttl(key) <= 61_000
    for _ in range(10):
        await append(redis, redis_prefix, key, 150, [str(i) for i in range(100)])
    assert 150 <= await redis.xlen(key) < 150 + NODE


async def test_an_entry_whose_stream_does_not_exist_goes_where_it_says_instead(
    redis: Any, redis_prefix: str
) -> None:
    own, shared = key_stream(redis_prefix, "acme"), key_stream(redis_prefix, "shared")
    await append(redis, redis_prefix, own, 1000, ["first"], instead=shared)
    assert not await redis.exists(own)
    assert [f[b"kind"] for _, f in await redis.xrange(shared)] == [b"first"]
    await append(redis, redis_prefix, own, 1000, ["admitted"])  # admission logged acme
    await append(redis, redis_prefix, own, 1000, ["second"], instead=shared)
    assert [f[b"kind"] for _, f in await redis.xrange(own)] == [b"admitted", b"second"]


async def test_nothing_is_written_with_the_log_off(redis: Any, redis_prefix: str) -> None:
    key = key_stream(redis_prefix, "acme")
    assert await append(redis, redis_prefix, key, 0, ["a"]) == []
    assert not await redis.exists(key)


async def test_the_writer_appends_every_field_off_the_call_path(
    redis: Any, redis_prefix: str
) -> None:
    writer = DecisionLogWriter(redis, redis_prefix, DecisionLogSettings(), "substrate")
    writer.append(
        "created", sandbox_id="sb-1", client="acme", key="acme", detail="created a new runtime"
    )
    writer.append("already_running", sandbox_id="sb-1", client="acme", key="acme")
    writer.append("hit", sandbox_id="sb-2", client="globex")  # no key: globex never logged
    writer.append("reaped", sandbox_id="sb-3")  # no client: the platform's
    await writer.close()  # writes what is queued
    entries = await redis.xrange(key_stream(redis_prefix, "acme"))
    assert [list(f) for _, f in entries] == [[name.encode() for name in FIELDS]] * 2
    assert [(f[b"service"], f[b"kind"]) for _, f in entries] == [
        (b"substrate", b"created"),
        (b"substrate", b"already_running"),
    ]
    # The sandbox's stream holds the same entries under the same ids.
    assert await redis.xrange(sandbox_stream(key_stream(redis_prefix, "acme"), "sb-1")) == entries
    shared = await redis.xrange(key_stream(redis_prefix, "shared"))
    assert [f[b"client"] for _, f in shared] == [b"globex"]
    platform = await redis.xrange(platform_stream(redis_prefix))
    assert [f[b"kind"] for _, f in platform] == [b"reaped"]
    off = DecisionLogWriter(
        redis, redis_prefix + "off:", DecisionLogSettings(max_entries=0), "affinity"
    )
    off.append("hit", sandbox_id="sb-1")
    await off.close()
    assert [k async for k in redis.scan_iter(match=f"{redis_prefix}off:*")] == []


async def test_a_platform_entry_is_written_at_once_to_the_platform_stream(
    redis: Any, redis_prefix: str
) -> None:
    entry_id = await append_platform_entry(
        redis,
        redis_prefix,
        DecisionLogSettings(),
        service="admission",
        kind="limits_changed",
        identity="spiffe://turnstile.test/operator/ops",
        detail='{"key": "acme", "old": {"cap": 10}, "new": {"cap": 20}}',
        key="acme",
    )
    ((got_id, fields),) = await redis.xrange(platform_stream(redis_prefix))
    assert got_id.decode() == entry_id
    assert (fields[b"kind"], fields[b"key"], fields[b"client"]) == (b"limits_changed", b"acme", b"")
    # Listed in the log's index, as every stream is (the export finds it there).
    assert await redis.zscore(streams_index(redis_prefix), platform_stream(redis_prefix))
    off = DecisionLogSettings(max_entries=0)
    kwargs: dict[str, Any] = {"service": "admission", "kind": "keys_changed"}
    assert await append_platform_entry(redis, redis_prefix + "off:", off, **kwargs) == ""
