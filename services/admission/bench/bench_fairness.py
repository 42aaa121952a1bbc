"""F1, heavy vs light: refuse-and-retry against the fair queue, in the same run (and F2).

    uv run python services/admission/bench/bench_fairness.py [--seconds 20] [--replicas 3]

Admission replicas run as processes of their own against one Redis (a prefix of
the run's own), the cluster bucket at ``--rate`` tokens/s (50) with a small burst,
every other policy off, so the cluster bucket alone is contended. Ten clients,
each its own bounded key, spread over the replicas:

* nine light clients, each needing an admission ``rate / 20`` times a second
  (open loop: a need arrives on time whether or not the last one was served);
* one heavy client, ``--heavy-loops`` loops that ask again as soon as they have
  an answer.

Two modes, one after the other on the same replicas:

* ``retry``: no wait budget. The heavy client retries at once on a refusal; a
  light one sleeps the refusal's RetryInfo and retries, until admitted (or 10 s).
* ``queue``: every call carries a 10 s wait budget and is answered once admitted.
* ``mixed``: the light clients queue (10 s budget); the heavy one keeps retrying at
  once without a budget, as in ``retry`` (it cannot jump the queue).

``--scenario f2`` runs F2 instead (SPEC Q2): a batch client (level ``batch``) with
``--heavy-loops`` loops flooding the queue, and a platform client (level
``platform``) needing ``rate / 4`` admissions a second, both queuing; it reports
the platform client's share of demand admitted, its p50/p99 wait (the goal:
within one refill interval of its guaranteed share, ``1 / (rate × 0.5)``) and
the levels' shares of the grants.

Per mode: each light client's share of its demand admitted, its p50/p99 wait
per admission and calls per admission; the heavy client's calls and
admissions; the bucket's utilization (admissions in the run ÷ what it could
grant: rate × seconds + burst); Jain's index over admitted ÷ max-min fair share
(light: its demand; heavy: the rest of the rate). Figures are printed, and the
last line is JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import redis.asyncio as aioredis

from turnstile_admission.fairness import jain_index
from turnstile_clientkeys.limits import Limits, LimitsStore
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2

LIGHT = [f"light-{n}" for n in range(1, 10)]
HEAVY = "heavy"
BUDGET_S = 10.0
BURST = 5


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def start_replica(
    port: int, redis_url: str, prefix: str, rate: float, extra: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    """An admission replica process with every policy but rate off (``extra``:
    more environment, over these)."""
    env = {
        **os.environ,
        "TURNSTILE_PORT": str(port),
        "TURNSTILE_METRICS_PORT": "0",
        "TURNSTILE_REDIS_URL": redis_url,
        "TURNSTILE_REDIS_PREFIX": prefix,
        "TURNSTILE_CLIENT_ALLOWLIST": json.dumps([HEAVY, *LIGHT, "platform", "batch"]),
        "TURNSTILE_LOG_LEVEL": "WARNING",
        "TURNSTILE_PLAINTEXT": "true",
        "TURNSTILE_CAP__MODE": "off",
        "TURNSTILE_CONCURRENCY__MODE": "off",
        "TURNSTILE_SLOTS__MODE": "off",
        "TURNSTILE_RATE__DEFAULT_RATE_PER_S": "100000",
        "TURNSTILE_RATE__DEFAULT_BURST": "100000",
        "TURNSTILE_RATE__CLUSTER_RATE_PER_S": str(rate),
        "TURNSTILE_RATE__CLUSTER_BURST": str(BURST),
        "TURNSTILE_HOLD_TTL_S": "5",
        "TURNSTILE_PENDING_TTL_S": "5",
        "TURNSTILE_RPC_TIMEOUT_S": "60",
        "OTEL_TRACES_EXPORTER": "none",
        **(extra or {}),
    }
    proc = subprocess.Popen([sys.executable, "-m", "turnstile_admission"], env=env)
    deadline = time.monotonic() + 60
    while True:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return proc
        if time.monotonic() > deadline or proc.poll() is not None:
            raise RuntimeError(f"admission on {port} did not start")
        time.sleep(0.1)


@dataclass
class ClientStats:
    demand: int = 0
    admitted: int = 0
    calls: int = 0
    waits: list[float] = field(default_factory=list)


def request(client: str, n: int, wait: bool) -> admission_pb2.AdmitRequest:
    r = admission_pb2.AdmitRequest(
        sandbox_id=f"{client}-{n}",
        client=common_pb2.ActivationClient(client_id=client),
        kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
    )
    if wait:
        r.wait_budget.FromMilliseconds(round(BUDGET_S * 1000))
    return r


async def run_mode(
    stubs: list[Any], mode: str, seconds: float, rate: float, heavy_loops: int
) -> dict[str, Any]:
    queue = mode in ("queue", "mixed")
    heavy_queues = mode == "queue"
    loop = asyncio.get_running_loop()
    stats = {c: ClientStats() for c in [HEAVY, *LIGHT]}
    admitted_in_run = 0
    start = loop.time()
    end = start + seconds
    counter = 0

    async def need(client: str, stub: Any) -> None:
        nonlocal counter, admitted_in_run
        s = stats[client]
        s.demand += 1
        began = loop.time()
        while loop.time() - began < BUDGET_S:
            counter += 1
            s.calls += 1
            answer = await stub.Admit(request(client, counter, queue), timeout=BUDGET_S + 5)
            if answer.decision == admission_pb2.DECISION_ADMITTED:
                s.admitted += 1
                s.waits.append(loop.time() - began)
                if loop.time() <= end:
                    admitted_in_run += 1
                return
            if queue:
                return  # its budget ended: refused after waiting
            await asyncio.sleep(answer.retry_after.ToMilliseconds() / 1000)

    async def light(index: int, client: str) -> None:
        stub = stubs[index % len(stubs)]
        period = 20 / rate
        tasks = []
        at = start + period * index / len(LIGHT)  # phases spread over a period
        while at < end:
            await asyncio.sleep(max(0.0, at - loop.time()))
            tasks.append(asyncio.create_task(need(client, stub)))
            at += period
        await asyncio.gather(*tasks)

    async def heavy(index: int) -> None:
        stub = stubs[index % len(stubs)]
        s = stats[HEAVY]
        nonlocal counter, admitted_in_run
        while loop.time() < end:
            counter += 1
            s.calls += 1
            timeout = min(BUDGET_S, max(0.05, end - loop.time()))
            r = request(HEAVY, counter, False)
            if heavy_queues:
                r.wait_budget.FromMilliseconds(round(timeout * 1000))
            began = loop.time()
            try:
                answer = await stub.Admit(r, timeout=timeout + 5)
            except grpc.aio.AioRpcError:
                continue
            if answer.decision == admission_pb2.DECISION_ADMITTED:
                s.admitted += 1
                s.demand += 1
                s.waits.append(loop.time() - began)
                if loop.time() <= end:
                    admitted_in_run += 1

    await asyncio.gather(
        *(light(i, c) for i, c in enumerate(LIGHT)), *(heavy(i) for i in range(heavy_loops))
    )
    capacity = rate * seconds + BURST
    light_demand_rate = rate / 20
    fair = dict.fromkeys(LIGHT, light_demand_rate * seconds)
    fair[HEAVY] = (rate - light_demand_rate * len(LIGHT)) * seconds
    x = [stats[c].admitted / fair[c] for c in fair]
    jain = jain_index(x)
    lights = [stats[c] for c in LIGHT]

    def q(values: list[float], p: float) -> float:
        if not values:
            return float("nan")
        values = sorted(values)
        return values[min(len(values) - 1, int(p * len(values)))]

    return {
        "mode": mode,
        "light_admitted_share": [round(s.admitted / max(1, s.demand), 3) for s in lights],
        "light_p50_wait_s": [round(q(s.waits, 0.5), 3) for s in lights],
        "light_p99_wait_s": [round(q(s.waits, 0.99), 3) for s in lights],
        "light_calls_per_admission": [round(s.calls / max(1, s.admitted), 2) for s in lights],
        "heavy_calls": stats[HEAVY].calls,
        "heavy_admitted": stats[HEAVY].admitted,
        "utilization": round(admitted_in_run / capacity, 3),
        "jain": round(jain, 4),
        "calls_per_admission_all": round(
            sum(s.calls for s in stats.values()) / max(1, sum(s.admitted for s in stats.values())),
            2,
        ),
    }


async def run_f2(stubs: list[Any], seconds: float, rate: float, loops: int) -> dict[str, Any]:
    loop = asyncio.get_running_loop()
    start = loop.time()
    end = start + seconds
    platform_waits: list[float] = []
    admitted = {"platform": 0, "batch": 0}
    demand = 0
    counter = 0

    async def platform_need(stub: Any) -> None:
        nonlocal counter
        counter += 1
        began = loop.time()
        answer = await stub.Admit(request("platform", counter, True), timeout=BUDGET_S + 5)
        if answer.decision == admission_pb2.DECISION_ADMITTED:
            platform_waits.append(loop.time() - began)
            admitted["platform"] += 1

    async def platform() -> None:
        nonlocal demand
        period, at, tasks = 4 / rate, start + 1.0, []  # after the flood has filled the queue
        while at < end:
            await asyncio.sleep(max(0.0, at - loop.time()))
            demand += 1
            tasks.append(asyncio.create_task(platform_need(stubs[demand % len(stubs)])))
            at += period
        await asyncio.gather(*tasks)

    async def batch(index: int) -> None:
        nonlocal counter
        stub = stubs[index % len(stubs)]
        while loop.time() < end:
            counter += 1
            r = request("batch", counter, False)
            r.wait_budget.FromMilliseconds(
                round(min(BUDGET_S, max(0.05, end - loop.time())) * 1000)
            )
            answer = await stub.Admit(r, timeout=BUDGET_S + 5)
            if answer.decision == admission_pb2.DECISION_ADMITTED:
                admitted["batch"] += 1

    await asyncio.gather(platform(), *(batch(i) for i in range(loops)))
    waits = sorted(platform_waits)

    def q(p: float) -> float:
        return round(waits[min(len(waits) - 1, int(p * len(waits)))], 3) if waits else float("nan")

    return {
        "mode": "f2",
        "platform_admitted_share": round(admitted["platform"] / max(1, demand), 3),
        "platform_p50_wait_s": q(0.5),
        "platform_p99_wait_s": q(0.99),
        "refill_interval_at_share_s": round(1 / (rate * 0.5), 3),
        "batch_admitted": admitted["batch"],
        "platform_admitted": admitted["platform"],
    }


def show(result: dict[str, Any]) -> None:
    if result["mode"] == "f2":
        for name, value in result.items():
            print(f"  {name:28} {value}")
        return

    def span(values: list[float]) -> str:
        return f"{min(values)}–{max(values)}"

    print(f"--- {result['mode']}")
    print(f"  light admitted share      {span(result['light_admitted_share'])}")
    print(f"  light p50 wait (s)        {span(result['light_p50_wait_s'])}")
    print(f"  light p99 wait (s)        {span(result['light_p99_wait_s'])}")
    print(f"  light calls per admission {span(result['light_calls_per_admission'])}")
    print(f"  heavy calls / admitted    {result['heavy_calls']} / {result['heavy_admitted']}")
    print(f"  bucket utilization        {result['utilization']}")
    print(f"  Jain (admitted/fair)      {result['jain']}")
    print(f"  calls per admission (all) {result['calls_per_admission_all']}")


async def main_async(args: argparse.Namespace) -> None:
    prefix = f"bench-fair-{os.getpid()}:"
    ports = [free_port() for _ in range(args.replicas)]
    procs = [start_replica(p, args.redis_url, prefix, args.rate) for p in ports]
    redis = aioredis.Redis.from_url(args.redis_url)
    channels = [grpc.aio.insecure_channel(f"127.0.0.1:{p}") for p in ports]
    stubs: list[Any] = [admission_pb2_grpc.AdmissionServiceStub(c) for c in channels]
    results = []
    try:
        if args.scenario == "f2":
            limits = LimitsStore(redis, prefix)
            await limits.set_key("platform", Limits(level="platform"))
            await limits.set_key("batch", Limits(level="batch"))
            await redis.delete(f"{prefix}{{adm}}:cluster-bucket")
            result = await run_f2(stubs, args.seconds, args.rate, args.heavy_loops * 4)
            print("--- f2")
            show(result)
            results.append(result)
        for mode in args.modes if args.scenario == "f1" else ():
            await redis.delete(f"{prefix}{{adm}}:cluster-bucket")
            result = await run_mode(stubs, mode, args.seconds, args.rate, args.heavy_loops)
            show(result)
            results.append(result)
            await asyncio.sleep(1)
    finally:
        await stop_replicas(channels, procs)
        keys = [k async for k in redis.scan_iter(match=f"{prefix}*")]
        if keys:
            await redis.delete(*keys)
        await redis.aclose()
    bench = f"fairness_{args.scenario}"
    print(json.dumps({"bench": bench, "seconds": args.seconds, "results": results}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0)
    parser.add_argument("--rate", type=float, default=50.0)
    parser.add_argument("--replicas", type=int, default=3)
    parser.add_argument("--heavy-loops", type=int, default=8)
    parser.add_argument("--modes", nargs="+", default=["retry", "queue", "mixed"])
    parser.add_argument("--scenario", choices=("f1", "f2"), default="f1")
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("TURNSTILE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0"),
    )
    run(main_async, parser.parse_args())


async def stop_replicas(
    channels: list[grpc.aio.Channel], procs: list[subprocess.Popen[bytes]]
) -> None:
    """Close the channels, then stop the replica processes (SIGTERM) and reap them."""
    for c in channels:
        await c.close(None)
    for proc in procs:
        proc.terminate()
    for proc in procs:
        proc.wait(10)


def run(work: Callable[[argparse.Namespace], Coroutine[Any, Any, None]], args: Any) -> None:
    """Run ``work(args)``, on uvloop when it is installed (as the services run)."""
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(work(args))


if __name__ == "__main__":
    main()
