"""What the owner check costs a ``Place`` hit (SPEC O2): ``place.lua`` as it is
against ``place.lua`` before sessions had owners, in the same run.

    uv run python services/affinity/bench/bench_place_owner.py [--rounds 5] [--against REV]

Both scripts run against one private redis-server, interleaved round by round
with a bare EVALSHA ceiling (``turnstile_testing.slot_bench``), each replaying one
hit exactly as its ``AffinityStore.place`` sends it: prune (nothing expired), the
record, presence, a lease taken, the load indexes updated (the same lease each
call: set sizes stay constant). The old scripts are read from git at ``REV``
(default: the last commit before SPEC O2/O3), set up with their own argument
layout under another prefix. Prints the slot table and the new ÷ old ratio.

The Python side of a hit changed by one remembered-set lookup (the client id's
validation) and two more keys and arguments written out; it prints those too,
timed with ``timeit`` against the same call without them.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import subprocess
import timeit
from pathlib import Path

import redis.asyncio as aioredis

from turnstile_affinity import validation
from turnstile_affinity.store import AffinityStore, Leased, Turn, script_text
from turnstile_testing.processes import RedisProcess
from turnstile_testing.slot_bench import SlotLoad, bare_load, measure, report

REPO = Path(__file__).resolve().parents[3]
SCRIPTS = "services/affinity/src/turnstile_affinity/scripts"
#: The last commit before sessions and presence had owners.
BEFORE = "f9ed8ec"
TTL_MS = 3_600_000
NEW, OLD = "new:", "old:"


def old_script(rev: str, name: str) -> str:
    def show(path: str) -> str:
        return subprocess.run(
            ["git", "show", f"{rev}:{SCRIPTS}/{path}"],
            cwd=REPO,
            check=True,
            capture_output=True,
            text=True,
        ).stdout

    return show("_lib.lua") + show(f"{name}.lua")


async def new_load(port: int) -> SlotLoad:
    client = aioredis.Redis(host="127.0.0.1", port=port)
    try:
        store = AffinityStore(client, NEW)
        for sandbox in ("sb-1", "sb-2", "sb-3"):
            status, _ = await store.attach(
                sandbox_id=sandbox,
                owner=f"owner-{sandbox}",
                tier="a",
                capacity=1_000_000,
                labels={"turnstile.dev/tier": "a"},
                endpoint="",
                presence_ttl_ms=TTL_MS,
                generation="",
                client="acme",
            )
            assert status == "ok"
        turn = Turn("session-1", "a", True, "lease-1", TTL_MS, TTL_MS, "acme", False)
        assert isinstance(await store.claim(turn), Leased)
        assert isinstance(await store.place(turn, grace_ms=60_000), Leased)
        keys, argv = store.place_request(turn, grace_ms=60_000)
    finally:
        await client.aclose()
    return SlotLoad("place.lua hit (owned)", script_text("place"), keys, argv)


async def old_load(port: int, rev: str) -> SlotLoad:
    client = aioredis.Redis(host="127.0.0.1", port=port)
    base = f"{OLD}{{affinity}}:"
    shared = [f"{base}load:all", f"{base}presence-expiry", f"{base}lease-expiry"]
    shared.append(f"{base}lease-sandbox")
    try:
        attach = client.register_script(old_script(rev, "attach"))
        claim = client.register_script(old_script(rev, "claim"))
        for sb in ("sb-1", "sb-2", "sb-3"):
            worker = [f"{base}{k}:{sb}" for k in ("presence", "detached", "wake", "credential")]
            status = await attach(
                keys=[*shared, *worker, f"{base}load:tier:a", f"{base}leases:{sb}"],
                args=[0, sb, f"owner-{sb}", "a", 1_000_000, json.dumps({}), "", TTL_MS, ""],
            )
            assert status[0] == b"ok", status
        keys = [*shared, f"{base}session:session-1", f"{base}load:tier:a"]
        args: list[str | int] = [0, "session-1", "a", "1", TTL_MS, "lease-1", TTL_MS]
        claimed = await claim(keys=keys, args=args)
        assert claimed[0] == b"first", claimed
    finally:
        await client.aclose()
    replay = [*args, 60_000, TTL_MS]
    return SlotLoad("place.lua hit (before)", old_script(rev, "place"), keys, replay)


def python_side() -> tuple[float, float]:
    """µs per call of the hit's Python work that changed: before and now."""
    store = AffinityStore(aioredis.Redis(), NEW)
    turn = Turn("session-1", "a", True, "lease-1", TTL_MS, TTL_MS, "acme", False)
    shared, base = store.keys.shared(), store.keys.base

    def before() -> object:
        # place_request as it was: six fields, two keys of its own.
        validation.session_id("session-1")
        session_id, session_tier, filtered, lease_id, lease_ttl_ms, record_ttl_ms = turn[:6]
        keys = [*shared, f"{base}session:{session_id}", f"{base}load:tier:{session_tier}"]
        args: list[str | int] = [
            0,
            session_id,
            session_tier,
            "1" if filtered else "0",
            lease_ttl_ms,
            lease_id,
            record_ttl_ms,
            60_000,
            record_ttl_ms,
        ]
        return keys, args

    def now() -> object:
        validation.session_id("session-1")
        validation.client_id("acme")
        return store.place_request(turn, grace_ms=60_000)

    n = 200_000
    runs = [(timeit.timeit(before, number=n), timeit.timeit(now, number=n)) for _ in range(5)]
    return (
        statistics.median(r[0] for r in runs) / n * 1e6,
        statistics.median(r[1] for r in runs) / n * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--requests", type=int, default=20_000, help="per load and round")
    parser.add_argument("--against", default=BEFORE, help="the git revision of 'before'")
    options = parser.parse_args()
    server = RedisProcess().start()
    try:
        new = asyncio.run(new_load(server.port))
        old = asyncio.run(old_load(server.port, options.against))
        bare = bare_load(f"{NEW}{{affinity}}:bare")
        figures = measure(
            server.port, [bare, old, new], rounds=options.rounds, requests=options.requests
        )
        print(report(figures, bare.name))
        ratios = [
            n.calls_per_s / o.calls_per_s
            for n, o in zip(figures[new.name], figures[old.name], strict=True)
        ]
        cpu = [
            n.cpu_us_per_call / o.cpu_us_per_call
            for n, o in zip(figures[new.name], figures[old.name], strict=True)
        ]
        print(
            f"owned ÷ before: calls/s {statistics.median(ratios):.3f} "
            f"[{min(ratios):.3f}–{max(ratios):.3f}], Redis CPU per call "
            f"{statistics.median(cpu):.3f} [{min(cpu):.3f}–{max(cpu):.3f}]"
        )
    finally:
        server.close()
    before_us, now_us = python_side()
    print(f"Python side of a hit that changed: {before_us:.2f} µs before, {now_us:.2f} µs now")


if __name__ == "__main__":
    main()
