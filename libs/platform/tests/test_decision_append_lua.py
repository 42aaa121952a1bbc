"""``decision_append.lua`` and :class:`DecisionLogWriter` against real Redis (SPEC Q3):
a batch is appended in order with one field list, within the log's bounds, and
nothing is written with the log off."""

from __future__ import annotations

from typing import Any

from turnstile_platform.decision_log import FIELDS, DecisionLogWriter, decisions_key
from turnstile_platform.redis_client import read_script
from turnstile_platform.settings import DecisionLogSettings

SCRIPT = read_script("turnstile_platform", "decision_append.lua")
NODE = 100  # stream-node-max-entries: '~' trims whole nodes


async def append(redis: Any, key: str, max_entries: int, kinds: list[str]) -> int:
    args: list[Any] = [max_entries, 60_000, 2]
    for kind in kinds:
        args += ["kind", kind, "service", "test"]
    return int(await redis.eval(SCRIPT, 1, key, *args))


async def test_a_batch_is_appended_in_order_within_its_bounds(
    redis: Any, redis_prefix: str
) -> None:
    key = decisions_key(redis_prefix)
    assert await append(redis, key, 1000, ["a", "b", "c"]) == 3
    assert [f[b"kind"] for _, f in await redis.xrange(key)] == [b"a", b"b", b"c"]
    # Expires a trim period (1 s) past max age, as admission's appends leave it.
    assert 60_000 < await redis.pttl(key) <= 61_000
    for _ in range(10):
        await append(redis, key, 150, [str(i) for i in range(100)])
    assert 150 <= await redis.xlen(key) < 150 + NODE


async def test_nothing_is_written_with_the_log_off(redis: Any, redis_prefix: str) -> None:
    key = decisions_key(redis_prefix)
    assert await append(redis, key, 0, ["a"]) == 0
    assert not await redis.exists(key)


async def test_the_writer_appends_every_field_off_the_call_path(
    redis: Any, redis_prefix: str
) -> None:
    writer = DecisionLogWriter(redis, redis_prefix, DecisionLogSettings(), "substrate")
    writer.append("created", sandbox_id="sb-1", client="acme", detail="created a new runtime")
    writer.append("already_running", sandbox_id="sb-1", client="acme")
    await writer.close()  # writes what is queued
    entries = await redis.xrange(decisions_key(redis_prefix))
    assert [list(f) for _, f in entries] == [[name.encode() for name in FIELDS]] * 2
    assert [(f[b"service"], f[b"kind"]) for _, f in entries] == [
        (b"substrate", b"created"),
        (b"substrate", b"already_running"),
    ]
    off = DecisionLogWriter(
        redis, redis_prefix + "off:", DecisionLogSettings(max_entries=0), "affinity"
    )
    off.append("hit", sandbox_id="sb-1")
    await off.close()
    assert not await redis.exists(decisions_key(redis_prefix + "off:"))
