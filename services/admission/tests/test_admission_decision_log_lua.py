"""``_decision_log.lua``, the decision log's append (SPEC Q3), run alone against
real Redis with the platform's ``_decision_stream.lua`` it calls: a stream's
bounds by length and by age, its expiry, its kinds and its verdicts document
(the sandbox streams and the index: ``libs/platform/tests/test_decision_stream_lua.py``)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import redis.asyncio as aioredis

from turnstile_platform.redis_client import read_script

#: What the include's stream nodes hold at most (Redis's stream-node-max-entries
#: default): '~' trims whole nodes, so a bound may be exceeded by less than one.
NODE = 100


def script(body: str) -> str:
    parts = [
        read_script("turnstile_admission", "_common.lua"),
        read_script("turnstile_platform", "_decision_stream.lua"),
        read_script("turnstile_admission", "_decision_log.lua"),
    ]
    return "\n".join([*parts, body])


# No sandbox streams: bounds {max entries, max age, 0 per sandbox, 1 sandbox}.
APPEND = script(
    "log_decision(KEYS[1], {tonumber(ARGV[1]), tonumber(ARGV[2]), 0, 1}, '', {'kind', ARGV[3]})"
    "\nreturn 1"
)


async def append(redis: aioredis.Redis, stream: str, max_entries: int, max_age_ms: int) -> None:
    await redis.eval(APPEND, 1, stream, max_entries, max_age_ms, "admitted")


async def test_length_is_bounded_within_one_node(redis: aioredis.Redis, redis_prefix: str) -> None:
    stream = f"{redis_prefix}{{adm}}:decisions"
    for _ in range(1000):
        await append(redis, stream, 150, 60_000)
    length = await redis.xlen(stream)
    assert 150 <= length < 150 + NODE


async def test_age_is_bounded_by_redis_time(redis: Any, redis_prefix: str) -> None:
    stream = f"{redis_prefix}{{adm}}:decisions"
    # A stream without an expiry (none of this include's writing) is trimmed at once.
    await old_entries(redis, stream)
    await append(redis, stream, 1000, 60_000)
    entries = await redis.xrange(stream)
    old = [e for e in entries if e[1][b"kind"] == b"old"]
    assert len(old) < NODE  # at most the part of a node the new entry shares
    assert entries[-1][1][b"kind"] == b"admitted"


#: The age trim's period (``LOG_TRIM_MS``) for max ages of 10 s and more.
PERIOD_MS = 1000


async def test_the_stream_expires_after_its_max_age(
    redis: aioredis.Redis, redis_prefix: str
) -> None:
    stream = f"{redis_prefix}{{adm}}:decisions"
    await append(redis, stream, 10, 30_000)
    # Never before its entries are max_age old; at most one trim period later.
    assert 30_000 < await redis.pttl(stream) <= 30_000 + PERIOD_MS
    # A short max age has a tenth of it as its period.
    short = f"{redis_prefix}{{adm}}:short"
    await append(redis, short, 10, 2_000)
    assert 2_000 < await redis.pttl(short) <= 2_200


async def old_entries(redis: Any, stream: str) -> None:
    """300 entries from 1970 (ids far older than any max age), three whole nodes."""
    for i in range(1, 301):
        await redis.xadd(stream, {"kind": "old"}, id=f"{i}-0")


async def test_the_age_trim_runs_once_a_period_not_on_every_append(
    redis: Any, redis_prefix: str
) -> None:
    stream = f"{redis_prefix}{{adm}}:decisions"
    await old_entries(redis, stream)
    # The expiry as a trim leaves it: within the period, appends leave the old
    # entries (the length bound still holds on every append).
    await redis.pexpire(stream, 60_000 + PERIOD_MS)
    for _ in range(3):
        await append(redis, stream, 1000, 60_000)
    kinds = [f[b"kind"] for _, f in await redis.xrange(stream)]
    assert kinds.count(b"old") == 300
    # Once a period has passed since that trim (what the TTL measures), the
    # next append trims by age and sets the expiry a period past max age again.
    await redis.pexpire(stream, 60_000 - 1)
    await append(redis, stream, 1000, 60_000)
    kinds = [f[b"kind"] for _, f in await redis.xrange(stream)]
    assert kinds.count(b"old") < NODE
    assert kinds[-1] == b"admitted"
    assert await redis.pttl(stream) > 60_000


async def test_zero_entries_turns_the_log_off(redis: aioredis.Redis, redis_prefix: str) -> None:
    stream = f"{redis_prefix}{{adm}}:decisions"
    await append(redis, stream, 0, 30_000)
    assert not await redis.exists(stream)


KIND = script(
    """
local results = cjson.decode(ARGV[2])
local modes = cjson.decode(ARGV[3])
local shadow = cjson.decode(ARGV[4])
return decision_kind(ARGV[1], results, modes, shadow)
"""
)


async def kind(
    redis: aioredis.Redis, outcome: str, codes: list[int], modes: list[int], shadow: Any = None
) -> str:
    results = [[c, 1, 0, -1, ""] for c in codes]
    raw = await redis.eval(
        KIND,
        0,
        outcome,
        json.dumps(results),
        json.dumps(modes),
        json.dumps(shadow or {"x": [0, 0, 0]}),
    )
    return raw.decode() if isinstance(raw, bytes) else str(raw)


async def test_decision_kinds(redis: aioredis.Redis) -> None:
    enforce = [2, 2, 2, 2]
    assert await kind(redis, "admit", [1, 1, 1, 1], enforce) == "admitted"
    assert await kind(redis, "refuse", [1, 2, 1, 1], enforce) == "refused"
    # Over in shadow mode, admitted: a shadow refusal.
    assert await kind(redis, "admit", [1, 2, 1, 1], [2, 1, 2, 2]) == "shadow_refused"
    # A shadow limit reached, admitted: a shadow refusal too.
    assert await kind(redis, "admit", [1, 1, 1, 1], enforce, {"cap": [2, 1, 1]}) == "shadow_refused"
    # An UNKNOWN verdict admits by design (the cap on a substrate that cannot count).
    assert await kind(redis, "admit", [1, 1, 3, 1], enforce) == "admitted"
    assert await kind(redis, "admit", [0, 0, 0, 0], [0, 0, 0, 0]) == "admitted"


VERDICTS = script(
    """
local results = {{0, 0, 0, -1, ''}, {1, 4, 2, -1, ''}, {2, 3, 3, 250, ''}, {3, 0, 0, -1, 'x'}}
local modes = {0, 2, 1, 2}
return verdicts_json(results, modes, {cap = {2, 2, 3}, rate = {0, 0, 0}})
"""
)


async def test_verdicts_document(redis: aioredis.Redis) -> None:
    doc = json.loads(await redis.eval(VERDICTS, 0))
    # The policy not evaluated (mode 0) is left out.
    assert [(v["p"], v["m"], v["v"], v["l"], v["c"]) for v in doc] == [
        ("concurrency", "enforce", "pass", 4, 2),
        ("cap", "shadow", "over", 3, 3),
        ("rate", "enforce", "unknown", 0, 0),
    ]
    assert doc[1]["s"] == {"v": "over", "l": 2, "c": 3}
    assert doc[1]["r"] == 250
    assert "r" not in doc[0]  # no hint: left out
    assert "d" not in doc[0]  # no detail: left out
    assert "s" not in doc[2]  # a shadow limit not set is left out
    assert doc[2]["d"] == "x"


NONE = script("return verdicts_json({{0, 0, 0, -1, ''}}, {0}, {})")


async def test_no_policy_evaluated_is_an_empty_array(redis: aioredis.Redis) -> None:
    assert json.loads(await redis.eval(NONE, 0)) == []


async def test_trimming_races_a_slow_consumer_group(redis: Any, redis_prefix: str) -> None:
    """The bounds do not wait for a shipper (docs/operations.md, "Shipping the
    decision log"): appends trim while a slow group reads; entries trimmed before
    it read them are never delivered, and those delivered but not acknowledged
    stay in its pending list as bare ids, which re-reading returns without fields
    and XAUTOCLAIM reports deleted (and drops)."""
    stream = f"{redis_prefix}{{adm}}:decisions"
    await redis.xgroup_create(stream, "shipper", id="$", mkstream=True)
    appends: asyncio.Queue[bool] = asyncio.Queue()
    delivered: list[bytes] = []
    unacked: list[bytes] = []

    async def appender() -> None:
        for _ in range(1000):
            await append(redis, stream, 150, 60_000)
            appends.put_nowait(True)
        appends.put_nowait(False)

    async def slow_reader() -> None:
        # One entry read for every ten appended, every other one acknowledged.
        seen = 0
        while await appends.get():
            seen += 1
            if seen % 10:
                continue
            got = await redis.xreadgroup("shipper", "s1", {stream: ">"}, count=1)
            for entry_id, fields in got[0][1]:
                assert fields[b"kind"] == b"admitted"  # '>' delivers only what exists
                delivered.append(entry_id)
                if len(delivered) % 2:
                    await redis.xack(stream, "shipper", entry_id)
                else:
                    unacked.append(entry_id)

    await asyncio.gather(appender(), slow_reader())
    assert len(delivered) == 100
    # The trim passed the reader by: its last entry is among the newest few
    # hundred, not the 100th appended (what reading in order would have given).
    assert delivered[-1] in {entry_id for entry_id, _ in await redis.xrange(stream)}
    group = (await redis.xinfo_groups(stream))[0]
    assert group["pending"] == len(unacked) == 50
    # Enough further appends that every entry the reader saw is trimmed.
    for _ in range(300):
        await append(redis, stream, 150, 60_000)
    assert 150 <= await redis.xlen(stream) < 150 + NODE
    left = {entry_id for entry_id, _ in await redis.xrange(stream)}
    assert not left & set(unacked)
    # The pending list still holds every unacknowledged id; re-reading it ('0')
    # returns them without fields.
    assert (await redis.xpending(stream, "shipper"))["pending"] == len(unacked)
    history = await redis.xreadgroup("shipper", "s1", {stream: "0"}, count=len(unacked))
    assert [entry_id for entry_id, _ in history[0][1]] == unacked
    assert all(not fields for _, fields in history[0][1])
    # Acknowledged, one goes; XAUTOCLAIM reports the rest deleted and drops them.
    assert await redis.xack(stream, "shipper", unacked[0]) == 1
    _, claimed, deleted = await redis.xautoclaim(
        stream, "shipper", "s2", 0, start_id="0-0", count=len(unacked)
    )
    assert claimed == []
    assert deleted == unacked[1:]
    assert (await redis.xpending(stream, "shipper"))["pending"] == 0
