"""F3, the fair queue at scale: 10,000 waiters over 1,000 keys, and the
uncontended Admit with queuing on vs off, in the same run (SPEC Q1).

    uv run python services/admission/bench/bench_queue_scale.py [--replicas 3] [--rate 500]

A private Redis (so its CPU is this benchmark's alone) and admission replicas as
processes of their own (``bench_fairness.start_replica``: every policy but rate
off).

* **Scale.** The cluster bucket is held shut (one token in 1000 s) while 10,000
  Admits with a wait budget, spread over 1,000 keys and the replicas, join the
  queue; after ``IDLE_S`` with nothing to grant (what the ticks alone cost Redis)
  it opens at ``--rate`` tokens/s (burst ``--burst``: at least a tick interval's
  refill, or tokens past the burst are lost between ticks) and the queue drains.
  Reported: Redis CPU (main thread, ``INFO cpu``) per join and per grant (the
  drain: ticks, claims, replies; and less the idle ticks' share), EVALSHA calls
  per grant, how far the k-th answer came behind the bucket's schedule
  (``t_k − (t_open + max(0, k − burst) / rate)``, p50/p99: what granting, waking
  and claiming add to the wait the rate imposes), and the drain's achieved rate
  ÷ ``--rate``. A call that failed (none expected: before the platform bounded
  gRPC's backlog of arrived calls at the server's own cap, 10–20 % came back
  CANCELLED before their handler ran) is counted in ``failed`` and never joins.
* **Uncontended, on vs off.** One replica with queuing on, one with it off
  (``TURNSTILE_QUEUE__MAX_WAIT_S=0``), the bucket never short; identical Admits
  (with a wait budget) at 64 in flight, ``--rounds`` alternating rounds of
  ``--seconds`` each. Reported: calls/s on ÷ off (median of the rounds' ratios),
  and Redis's and the replica's CPU per call on ÷ off (the steadier figure on a
  shared machine: a round's throughput moves with everyone else's load). The
  goal: within 3 %.

The load average at the start and the end is printed; the last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
from collections import Counter
from typing import Any

import grpc.aio
import redis.asyncio as aioredis
from bench_admit import redis_cpu_s
from bench_fairness import free_port, run, start_replica, stop_replicas

from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_testing.processes import RedisProcess

#: How long the full queue is left with nothing to grant, to measure its ticks' cost.
IDLE_S = 2.0
#: F3's scale (``--waiters``, ``--keys`` for a quicker look).
WAITERS, KEY_COUNT = 10_000, 1000
PREFIX = "bench-f3:"
INFLIGHT = 64


def admit(key: str, n: int, budget_s: float) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        sandbox_id=f"sb-{n}",
        client=common_pb2.ActivationClient(client_id=key),
        kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
    )
    request.wait_budget.FromSeconds(round(budget_s))
    return request


async def evalsha_calls(redis: aioredis.Redis) -> int:
    info = await redis.info("commandstats")
    return int(info.get("cmdstat_evalsha", {}).get("calls", 0))


def quantile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(p * len(ordered)))]


async def scale(
    stubs: list[Any],
    redis: aioredis.Redis,
    rate: float,
    burst: float,
    waiters: int,
    keys: list[str],
) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    limits = LimitsStore(redis, PREFIX)
    await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))
    await stubs[0].Admit(admit(keys[0], -1, 0))  # the burst's one token
    budget_s = waiters / rate * 3 + 30
    answered: list[float] = []
    decisions: list[int] = []

    failed: list[str] = []

    async def one(n: int) -> None:
        try:
            answer = await stubs[n % len(stubs)].Admit(
                admit(keys[n % len(keys)], n, budget_s), timeout=budget_s + 30
            )
        except grpc.aio.AioRpcError as error:
            failed.append(error.code().name)
            return
        answered.append(loop.time())
        decisions.append(answer.decision)

    cpu_start = await redis_cpu_s(redis)
    tasks = [asyncio.ensure_future(one(n)) for n in range(waiters)]
    joined = 0
    while joined + len(failed) < waiters:
        await asyncio.sleep(0.05)
        joined = int(await redis.hlen(f"{PREFIX}{{adm}}:q:info"))
        print(f"  joined {joined}, failed {len(failed)}", file=sys.stderr)
    print(file=sys.stderr)
    cpu_joined = await redis_cpu_s(redis)
    # What the replicas' ticks cost Redis with the queue full and nothing to grant.
    await asyncio.sleep(IDLE_S)
    cpu_idle, calls_joined = await redis_cpu_s(redis), await evalsha_calls(redis)
    idle_per_s = (cpu_idle - cpu_joined) / IDLE_S
    await limits.set_cluster(ClusterLimits(rate=rate, burst=burst))
    opened = loop.time()
    await asyncio.gather(*tasks)
    cpu_end, calls_end = await redis_cpu_s(redis), await evalsha_calls(redis)
    admitted = sum(1 for d in decisions if d == admission_pb2.DECISION_ADMITTED)
    if failed:
        print(f"  failed calls: {Counter(failed)}", file=sys.stderr)
    # The bucket opens full (``burst`` at once), then refills at ``rate``.
    behind = [t - (opened + max(0.0, k + 1 - burst) / rate) for k, t in enumerate(sorted(answered))]
    drained = max(answered) - opened
    return {
        "waiters": waiters,
        "keys": len(keys),
        "admitted": admitted,
        "failed": len(failed),
        "redis_cpu_us_per_join": round((cpu_joined - cpu_start) / waiters * 1e6, 1),
        "redis_cpu_us_per_grant": round((cpu_end - cpu_idle) / max(1, admitted) * 1e6, 1),
        "redis_cpu_ms_per_s_idle_ticks": round(idle_per_s * 1e3, 2),
        "redis_cpu_us_per_grant_less_idle_ticks": round(
            (cpu_end - cpu_idle - idle_per_s * drained) / max(1, admitted) * 1e6, 1
        ),
        "evalsha_per_grant": round((calls_end - calls_joined) / max(1, admitted), 3),
        "behind_schedule_p50_s": round(quantile(behind, 0.5), 4),
        "behind_schedule_p99_s": round(quantile(behind, 0.99), 4),
        "drain_rate_ratio": round(admitted / drained / rate, 3),
    }


async def closed_loop(stub: Any, seconds: float, start: int, keys: list[str]) -> int:
    """Calls completed with ``INFLIGHT`` in flight for ``seconds``."""
    loop = asyncio.get_running_loop()
    end = loop.time() + seconds
    done = 0

    async def worker(w: int) -> None:
        nonlocal done
        n = start + w
        while loop.time() < end:
            await stub.Admit(admit(keys[n % len(keys)], n, 10), timeout=10)
            done += 1
            n += INFLIGHT

    await asyncio.gather(*(worker(w) for w in range(INFLIGHT)))
    return done


def cpu_s(pid: int) -> float:
    """CPU seconds (user + system) of process ``pid`` so far."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def on_off(
    on: tuple[Any, int],
    off: tuple[Any, int],
    redis: aioredis.Redis,
    seconds: float,
    rounds: int,
    keys: list[str],
) -> dict[str, Any]:
    """``on``, ``off``: each replica's stub and process id."""
    await LimitsStore(redis, PREFIX).set_cluster(ClusterLimits(rate=1e9, burst=1e9))
    await closed_loop(on[0], 1.0, 10_000_000, keys)  # warm both up
    await closed_loop(off[0], 1.0, 20_000_000, keys)
    ratios, cpu_ratios, server_ratios = [], [], []
    n = 30_000_000
    for r in range(rounds):
        measured: dict[str, tuple[float, float, float]] = {}
        # Alternate which goes first, so a drift in the machine's speed cancels.
        order = (("on", on), ("off", off)) if r % 2 == 0 else (("off", off), ("on", on))
        for name, (stub, pid) in order:
            cpu, server = await redis_cpu_s(redis), cpu_s(pid)
            calls = await closed_loop(stub, seconds, n, keys)
            n += 10_000_000
            measured[name] = (
                calls / seconds,
                (await redis_cpu_s(redis) - cpu) / calls,
                (cpu_s(pid) - server) / calls,
            )
        ratios.append(measured["on"][0] / measured["off"][0])
        cpu_ratios.append(measured["on"][1] / measured["off"][1])
        server_ratios.append(measured["on"][2] / measured["off"][2])
    return {
        "rounds": rounds,
        "calls_per_s_on_over_off": round(statistics.median(ratios), 3),
        "calls_per_s_on_over_off_range": [round(min(ratios), 3), round(max(ratios), 3)],
        "redis_cpu_per_call_on_over_off": round(statistics.median(cpu_ratios), 3),
        "server_cpu_per_call_on_over_off": round(statistics.median(server_ratios), 3),
        "server_cpu_per_call_on_over_off_range": [
            round(min(server_ratios), 3),
            round(max(server_ratios), 3),
        ],
    }


async def main_async(args: argparse.Namespace) -> None:
    load_start = os.getloadavg()
    server = RedisProcess().start()
    keys = [f"k{n}" for n in range(args.keys)]
    allow = {"TURNSTILE_CLIENT_ALLOWLIST": json.dumps(keys)}
    scale_env = {
        **allow,
        "TURNSTILE_RATE__CLUSTER_BURST": "1",
        "TURNSTILE_MAX_CONCURRENT_RPCS": str(args.waiters + 1000),
        "TURNSTILE_QUEUE__MAX_WAITERS": str(args.waiters * 2),
        "TURNSTILE_QUEUE__MAX_WAIT_S": "600",
        "TURNSTILE_HOLD_TTL_S": "60",
        "TURNSTILE_PENDING_TTL_S": "60",
    }
    ports = [free_port() for _ in range(args.replicas)]
    procs = [start_replica(p, server.url, PREFIX, args.rate, scale_env) for p in ports]
    off_port = free_port()
    off_env = {**scale_env, "TURNSTILE_QUEUE__MAX_WAIT_S": "0"}
    procs.append(start_replica(off_port, server.url, PREFIX, args.rate, off_env))
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in [*ports, off_port]]
    stubs: list[Any] = [admission_pb2_grpc.AdmissionServiceStub(c) for c in channels]
    redis = aioredis.Redis.from_url(server.url)
    try:
        result: dict[str, Any] = {}
        if args.only in (None, "scale"):
            result["scale"] = await scale(
                stubs[:-1], redis, args.rate, args.burst, args.waiters, keys
            )
        if args.only in (None, "uncontended"):
            result["uncontended"] = await on_off(
                (stubs[0], procs[0].pid),
                (stubs[-1], procs[-1].pid),
                redis,
                args.seconds,
                args.rounds,
                keys,
            )
    finally:
        await stop_replicas(channels, procs)
        await redis.aclose()
        server.close()
    result["load_average"] = [load_start[0], os.getloadavg()[0]]
    for part in ("scale", "uncontended"):
        if part not in result:
            continue
        print(f"--- {part}")
        for name, value in result[part].items():
            print(f"  {name:34} {value}")
    print(f"  load average (1 min), start / end   {result['load_average']}")
    print(json.dumps({"bench": "fairness_f3", "rate": args.rate, **result}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--burst", type=float, default=50.0)
    parser.add_argument("--seconds", type=float, default=3.0)
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--waiters", type=int, default=WAITERS)
    parser.add_argument("--only", choices=("scale", "uncontended"))
    parser.add_argument("--keys", type=int, default=KEY_COUNT)
    run(main_async, parser.parse_args())


if __name__ == "__main__":
    main()
