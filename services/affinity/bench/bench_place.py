"""Place benchmark: throughput and latency against ceilings measured in the same run.

    uv run python services/affinity/bench/bench_place.py [--seconds 3] [--concurrency 64]

What it runs, each server in its own process on 127.0.0.1, all against one
private redis-server (so INFO commandstats counts only this run):

- ceiling ``echo``: a bare grpc.aio unary echo;
- ceiling ``evalsha``: the same, whose handler runs one EVALSHA;
- ceiling ``platform``: that handler behind the platform's ``GrpcService``
  (its interceptor: server spans, limits, RPC metrics, rich errors), which every service
  pays before its own code runs;
- the affinity service itself (``create_app``), tiers ``small`` (10 sandboxes)
  and ``big`` (10,000 sandboxes), presence put through its own attach script.

It reports, for an affinity hit (the session's sandbox present with a free
slot) and for a first turn (least-loaded selection through the tier's load
index): calls/s and p50/p99 with 64 calls in flight and with one, the ratio to
the EVALSHA ceiling (a hit is one gRPC call and one EVALSHA, so that ceiling is
its bound), Redis commands and round trips per placement, and how p99 moves
from 10 to 10,000 sandboxes in one tier. Then hits on both tiers again, each
right after its own ceiling phase, in rounds whose order alternates (at least
two; ``--rounds``): per-round ratios and the affinity server's CPU per RPC
against the ceiling server's, the figures to compare the tiers by (in one pass
whichever tier runs first reads lower). Each turn releases its lease with
ReleaseLease (itself one gRPC call and one EVALSHA), as a real turn does; the
ratio compares RPCs/s (Place + ReleaseLease) with the ceiling's calls/s.

Then the cost of transport security (SPEC Z1, Z2), a hit in the small tier on
three affinity servers taken in turn: ``plaintext``; ``mtls`` (mutual TLS, the
authorization check replaced by a pass-through — a bench-only patch); and
``mtls+authz`` (the real policy from deploy/, called as the gateway identity).
Measured in interleaved rounds (``--rounds``, 3 by default); reported as the
median per-round ratio and its range: mtls / plaintext (TLS cost) and
mtls+authz / mtls (authorization cost; goal within 5 %).

Then the cost of the decision log (SPEC Q3) on Place: hits in the small tier on the
affinity server above (the log on) and on one started with the log off
(``TURNSTILE_DECISION_LOG__MAX_ENTRIES=0``), taken in turn for ``--rounds``
rounds, the order flipped every round. Reported as the median per-round ratio
(on ÷ off) of RPCs/s, of the server's CPU per RPC and of the server's plus
redis-server's CPU per RPC (the steadier measure on a shared machine).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import redis.asyncio as aioredis
import uvloop

from turnstile_affinity.app import create_app
from turnstile_affinity.settings import AffinitySettings
from turnstile_affinity.store import AffinityStore
from turnstile_contracts import affinity_pb2, affinity_pb2_grpc
from turnstile_platform import tls
from turnstile_platform.pki import ensure_local_pki
from turnstile_platform.server import GrpcService
from turnstile_platform.tiers import TIER_LABEL
from turnstile_testing.authz import without_authorization
from turnstile_testing.processes import RedisProcess

PREFIX = "bench:"
SMALL, BIG = 10, 10_000
CAPACITY = 1024
POLICY = Path(__file__).resolve().parents[3] / "deploy/kustomize/base/authz-policy.toml"
HOLDERS = {"affinity": "service/affinity", "gateway": "service/gateway"}
SECURE_MODES = ("mtls", "mtls+authz")


# Servers (child processes) -----------------------------------------------------------


async def _serve_ceiling(kind: str, redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    script = client.register_script("return redis.call('INCR', KEYS[1])")
    if kind == "platform":
        # The same handler behind the platform's bootstrap: tracing and RPC metrics.
        settings = AffinitySettings(
            port=0, metrics_port=0, worker_attestation="off", plaintext=True
        )
        server = GrpcService("bench", settings, service_names=[]).server
    else:
        server = grpc.aio.server()

    async def call(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        if kind != "echo":
            await script(keys=["bench:ceiling"])
        return request

    handler = grpc.method_handlers_generic_handler(
        "bench.Ceiling", {"Call": grpc.unary_unary_rpc_method_handler(call)}
    )
    server.add_generic_rpc_handlers((handler,))
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    print(port, flush=True)
    await server.wait_for_termination()


def _files(directory: Path, holder: str) -> tls.TlsFiles:
    return tls.TlsFiles(
        directory / f"{holder}.crt", directory / f"{holder}.key", directory / "ca.crt"
    )


def _security(mode: str) -> dict[str, Any]:
    """Settings of one transport mode (``BENCH_TLS_DIR`` holds the files)."""
    if mode == "plaintext":
        return {"plaintext": True}
    if mode == "mtls":
        without_authorization()
    directory = Path(os.environ["BENCH_TLS_DIR"])
    files = _files(directory, "affinity")
    return {
        "tls_cert_file": files.cert_file,
        "tls_key_file": files.key_file,
        "tls_ca_file": files.ca_file,
        "authz_policy_file": directory / "policy.toml",
    }


async def _serve_affinity(redis_url: str, mode: str = "plaintext") -> None:
    settings = AffinitySettings(
        **_security(mode),
        redis_url=redis_url,  # type: ignore[arg-type]
        redis_prefix=PREFIX,
        port=0,
        metrics_port=0,
        tiers="small,big",
        wake_enabled=False,
        heartbeat_interval_s=300,
        presence_ttl_s=900,
        log_level="WARNING",
        # Presence is put straight into Redis (_populate): no worker attaches.
        worker_attestation="off",
    )
    app = await create_app(settings)
    print(await app.start(), flush=True)
    await app.server.wait_for_termination()


def _start_server(
    kind: str, redis_url: str, env: dict[str, str] | None = None
) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, "--redis", redis_url],
        stdout=subprocess.PIPE,
        text=True,
        # Tracing on with the production overlay's sampler (spans kept in process).
        env={
            **os.environ,
            "OTEL_TRACES_EXPORTER": "none",
            "OTEL_TRACES_SAMPLER": "parentbased_traceidratio",
            "OTEL_TRACES_SAMPLER_ARG": "0.1",
            **(env or {}),
        },
    )
    assert proc.stdout is not None
    port = proc.stdout.readline().strip()
    return proc, f"127.0.0.1:{port}"


# Load generation ---------------------------------------------------------------------


@dataclass
class Run:
    calls: int
    seconds: float
    latencies_ms: list[float]

    @property
    def rate(self) -> float:
        return self.calls / self.seconds

    def pct(self, q: float) -> float:
        ordered = sorted(self.latencies_ms)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _drive(step: Callable[[int], Awaitable[float]], concurrency: int, seconds: float) -> Run:
    """Run ``step(worker)`` (returning the timed latency) from ``concurrency`` loops."""
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def loop(worker: int) -> None:
        while time.perf_counter() < deadline:
            latencies.append(await step(worker))

    started = time.perf_counter()
    await asyncio.gather(*(loop(i) for i in range(concurrency)))
    return Run(len(latencies), time.perf_counter() - started, latencies)


async def _ceiling(address: str, concurrency: int, seconds: float) -> Run:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary("/bench.Ceiling/Call", None, None)  # bytes in, bytes out

        async def step(_: int) -> float:
            t = time.perf_counter()
            await call(b"x")
            return (time.perf_counter() - t) * 1000

        await _drive(step, concurrency, 0.5)  # warm-up
        return await _drive(step, concurrency, seconds)


async def _place_turns(
    stub: affinity_pb2_grpc.AffinityServiceAsyncStub,
    tier: str,
    concurrency: int,
    seconds: float,
    *,
    first_turns: bool,
) -> Run:
    """Turns of Place (timed) then ReleaseLease; hits reuse one session per loop."""
    sessions = [f"{tier}-hit-{i}" for i in range(concurrency)]
    for session in sessions:  # first turns, so the timed ones are hits
        placed = await stub.Place(
            affinity_pb2.PlaceRequest(client_id="acme", session_id=session, tier=tier)
        )
        await stub.ReleaseLease(
            affinity_pb2.ReleaseLeaseRequest(sandbox_id=placed.sandbox_id, lease_id=placed.lease_id)
        )

    async def step(worker: int) -> float:
        session = f"{tier}-first-{uuid.uuid4().hex}" if first_turns else sessions[worker]
        t = time.perf_counter()
        placed = await stub.Place(
            affinity_pb2.PlaceRequest(client_id="acme", session_id=session, tier=tier)
        )
        elapsed = (time.perf_counter() - t) * 1000
        await stub.ReleaseLease(
            affinity_pb2.ReleaseLeaseRequest(sandbox_id=placed.sandbox_id, lease_id=placed.lease_id)
        )
        return elapsed

    await _drive(step, concurrency, 0.5)  # warm-up
    return await _drive(step, concurrency, seconds)


async def _commands_per(
    redis: aioredis.Redis, action: Callable[[], Awaitable[None]], n: int
) -> tuple[float, float]:
    """(Redis commands, EVALSHA round trips) per ``action``, from INFO commandstats."""
    await redis.config_resetstat()
    for _ in range(n):
        await action()
    stats = await redis.info("commandstats")
    total = sum(v["calls"] for k, v in stats.items() if k not in ("cmdstat_config", "cmdstat_info"))
    evalsha = stats.get("cmdstat_evalsha", {}).get("calls", 0)
    return total / n, evalsha / n


async def _populate(redis_url: str) -> None:
    """Put presence for both tiers through the service's own attach script."""
    redis = aioredis.Redis.from_url(redis_url)
    store = AffinityStore(redis, PREFIX)
    sandboxes = [(f"s{i:03d}", "small") for i in range(SMALL)]
    sandboxes += [(f"b{i:05d}", "big") for i in range(BIG)]
    for start in range(0, len(sandboxes), 100):
        await asyncio.gather(
            *(
                store.attach(
                    sandbox_id=sandbox_id,
                    owner="bench",
                    tier=tier,
                    capacity=CAPACITY,
                    labels={TIER_LABEL: tier},
                    endpoint="",
                    presence_ttl_ms=900_000,
                    generation="bench",  # as if its credential was verified
                    client="acme",  # the sessions' client owns them all (SPEC O2)
                )
                for sandbox_id, tier in sandboxes[start : start + 100]
            )
        )
    await redis.aclose()


def _row(name: str, run: Run, ceiling: float | None = None, rpcs_per_call: int = 1) -> str:
    ratio = f"{run.rate * rpcs_per_call / ceiling:5.2f}" if ceiling else "    -"
    return (
        f"{name:<44} {run.rate:7.0f}/s  p50 {run.pct(0.50):6.2f} ms  "
        f"p99 {run.pct(0.99):6.2f} ms  ratio {ratio}"
    )


async def _bench(seconds: float, concurrency: int, rounds: int) -> dict[str, object]:
    redis_proc = RedisProcess().start()
    procs: list[subprocess.Popen[str]] = []
    try:
        url = redis_proc.url
        results: dict[str, object] = {}
        print(
            f"private redis-server on {url}; {seconds:.0f} s per phase, {concurrency} in flight\n"
        )

        await _populate(url)
        echo_proc, echo = _start_server("echo", url)
        evalsha_proc, evalsha = _start_server("evalsha", url)
        platform_proc, platform = _start_server("platform", url)
        affinity_proc, affinity = _start_server("affinity", url)
        procs += [echo_proc, evalsha_proc, platform_proc, affinity_proc]
        half = seconds / 2
        async with grpc.aio.insecure_channel(affinity) as channel:
            stub: affinity_pb2_grpc.AffinityServiceAsyncStub = (
                affinity_pb2_grpc.AffinityServiceStub(channel)
            )

            def turns(tier: str, n: int, length: float, first: bool) -> Awaitable[Run]:
                return _place_turns(stub, tier, n, length, first_turns=first)

            # Each affinity phase runs right after a ceiling phase of the same shape,
            # so a ratio compares two figures taken a few seconds apart on a noisy box.
            echo_c = await _ceiling(echo, concurrency, seconds)
            echo_1 = await _ceiling(echo, 1, half)
            eval_c = await _ceiling(evalsha, concurrency, seconds)
            hit_small = await turns("small", concurrency, seconds, False)
            platform_c = await _ceiling(platform, concurrency, seconds)
            eval_c2 = await _ceiling(evalsha, concurrency, seconds)
            hit_big = await turns("big", concurrency, seconds, False)
            eval_1 = await _ceiling(evalsha, 1, half)
            hit_small_1 = await turns("small", 1, half, False)
            platform_1 = await _ceiling(platform, 1, half)
            eval_12 = await _ceiling(evalsha, 1, half)
            hit_big_1 = await turns("big", 1, half, False)
            first_small = await turns("small", concurrency, seconds, True)
            first_big = await turns("big", concurrency, seconds, True)
            first_small_1 = await turns("small", 1, half, True)
            first_big_1 = await turns("big", 1, half, True)

            redis = aioredis.Redis.from_url(url)
            placed = await stub.Place(
                affinity_pb2.PlaceRequest(client_id="acme", session_id="count", tier="big")
            )
            await stub.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(
                    sandbox_id=placed.sandbox_id, lease_id=placed.lease_id
                )
            )

            async def hit() -> None:
                await stub.Place(
                    affinity_pb2.PlaceRequest(client_id="acme", session_id="count", tier="big")
                )

            async def first() -> None:
                session = f"count-{uuid.uuid4().hex}"
                await stub.Place(
                    affinity_pb2.PlaceRequest(client_id="acme", session_id=session, tier="big")
                )

            alternating = await _hits_alternating(
                stub,
                evalsha,
                {
                    "evalsha": evalsha_proc.pid,
                    "affinity": affinity_proc.pid,
                    "redis": redis_proc.pid,
                },
                seconds,
                concurrency,
                max(rounds, 2),
            )
            hit_cmds, hit_trips = await _commands_per(redis, hit, 500)
            first_cmds, first_trips = await _commands_per(redis, first, 500)
            await redis.aclose()

        print(f"{'':<44} {'rate':>9}  {'':>14}  {'':>14}  RPCs/s ÷ ceiling before it")
        print(_row("ceiling: gRPC echo, 64 in flight", echo_c))
        print(_row("ceiling: gRPC echo, sequential", echo_1))
        print(_row("ceiling: gRPC + 1 EVALSHA, 64 in flight", eval_c))
        print(_row(f"Place hit, {SMALL} sandboxes, 64 in flight", hit_small, eval_c.rate, 2))
        print(_row("ceiling: platform bootstrap + 1 EVALSHA, 64", platform_c))
        print(_row("ceiling: gRPC + 1 EVALSHA, 64 in flight", eval_c2))
        print(_row(f"Place hit, {BIG} sandboxes, 64 in flight", hit_big, eval_c2.rate, 2))
        print(_row("ceiling: gRPC + 1 EVALSHA, sequential", eval_1))
        print(_row(f"Place hit, {SMALL} sandboxes, sequential", hit_small_1, eval_1.rate, 2))
        print(_row("ceiling: platform bootstrap + 1 EVALSHA, seq.", platform_1))
        print(_row("ceiling: gRPC + 1 EVALSHA, sequential", eval_12))
        print(_row(f"Place hit, {BIG} sandboxes, sequential", hit_big_1, eval_12.rate, 2))
        print(_row(f"first turn, {SMALL} sandboxes, 64 in flight", first_small))
        print(_row(f"first turn, {BIG} sandboxes, 64 in flight", first_big))
        print(_row(f"first turn, {SMALL} sandboxes, sequential", first_small_1))
        print(_row(f"first turn, {BIG} sandboxes, sequential", first_big_1))
        print(
            f"\nRedis per placement: hit {hit_cmds:.1f} commands in {hit_trips:.1f} round trip(s); "
            f"first turn {first_cmds:.1f} commands in {first_trips:.1f} round trip(s)"
        )
        print(
            f"sequential p99 from {SMALL} to {BIG} sandboxes: hit {hit_small_1.pct(0.99):.2f} → "
            f"{hit_big_1.pct(0.99):.2f} ms; first turn {first_small_1.pct(0.99):.2f} → "
            f"{first_big_1.pct(0.99):.2f} ms"
        )
        results = {
            "ceiling_echo_per_s": round(echo_c.rate),
            "ceiling_evalsha_per_s": round(eval_c.rate),
            "hit_turns_per_s": round(hit_small.rate),
            "hit_rpc_ratio_to_evalsha_ceiling": round(hit_small.rate * 2 / eval_c.rate, 2),
            "hit_p50_ms": round(hit_small.pct(0.5), 2),
            "hit_p99_ms": round(hit_small.pct(0.99), 2),
            "hit_sequential_p50_ms": round(hit_small_1.pct(0.5), 2),
            "ceiling_platform_per_s": round(platform_c.rate),
            "ceiling_platform_sequential_p50_ms": round(platform_1.pct(0.5), 2),
            "hit_sequential_p50_over_platform_p50": round(
                hit_small_1.pct(0.5) / platform_1.pct(0.5), 2
            ),
            "hit_sequential_p99_ms": round(hit_small_1.pct(0.99), 2),
            "ceiling_evalsha_sequential_p50_ms": round(eval_1.pct(0.5), 2),
            "hit_sequential_p99_ms_10k": round(hit_big_1.pct(0.99), 2),
            "first_sequential_p99_ms_10": round(first_small_1.pct(0.99), 2),
            "first_sequential_p99_ms_10k": round(first_big_1.pct(0.99), 2),
            "first_p99_ms_10": round(first_small.pct(0.99), 2),
            "first_p99_ms_10k": round(first_big.pct(0.99), 2),
            "redis_commands_per_hit": round(hit_cmds, 1),
            "redis_commands_per_first_turn": round(first_cmds, 1),
            "round_trips_per_hit": hit_trips,
            "round_trips_per_first_turn": first_trips,
        }
        results |= alternating
        if rounds:
            results |= await _bench_security(url, affinity, seconds, concurrency, procs, rounds)
            results |= await _bench_decision_log(
                url,
                affinity,
                {"affinity": affinity_proc.pid, "redis": redis_proc.pid},
                seconds,
                concurrency,
                procs,
                rounds,
            )
        print("\n" + json.dumps(results))
        return results
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(10)
        redis_proc.close()


def _cpu_s(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _hits_alternating(
    stub: affinity_pb2_grpc.AffinityServiceAsyncStub,
    ceiling: str,
    pids: dict[str, int],
    seconds: float,
    concurrency: int,
    rounds: int,
) -> dict[str, object]:
    """Hits on 10 and on 10,000 sandboxes, each right after an EVALSHA ceiling phase,
    in ``rounds`` rounds whose order alternates (small first, then big first).

    One pass of the main table puts the small tier's hit first after a ceiling
    phase every time, and a single ceiling figure swings by 1.5x between two
    back-to-back phases here: whichever tier ran first read lower (measured both
    ways). Per-round ratios, and the affinity server's CPU per RPC against the
    ceiling server's, are the figures to compare across tiers.

    Besides the server's, the CPU per RPC of the two other processes every call
    runs through: this client (its RPCs carry protobuf messages, the ceiling's
    raw bytes) and redis-server (``place.lua`` and ``release.lua`` against the
    ceiling's one ``INCR``). On a machine the three keep busy, the throughput
    ratio follows the ratio of their sum (``hit_total_cpu_per_rpc_over_ceiling_*``)."""
    ratios: dict[str, list[float]] = {"small": [], "big": []}
    cpu: dict[str, list[float]] = {"small": [], "big": []}
    parts: dict[str, dict[str, list[float]]] = {
        tier: {"client": [], "redis": [], "total": []} for tier in ("small", "big")
    }

    def used() -> tuple[float, float]:
        return time.process_time(), _cpu_s(pids["redis"])

    for r in range(rounds):
        for tier in ("small", "big") if r % 2 == 0 else ("big", "small"):
            before = _cpu_s(pids["evalsha"])
            client_0, redis_0 = used()
            ceiling_run = await _ceiling(ceiling, concurrency, seconds)
            # The ceiling's 0.5 s warm-up runs at the same rate: count its calls too.
            calls = ceiling_run.rate * (seconds + 0.5)
            ceiling_cpu = (_cpu_s(pids["evalsha"]) - before) / calls
            client_1, redis_1 = used()
            ceiling_client = (client_1 - client_0) / calls
            ceiling_redis = (redis_1 - redis_0) / calls
            before = _cpu_s(pids["affinity"])
            run = await _place_turns(stub, tier, concurrency, seconds, first_turns=False)
            rpcs = 2 * run.rate * (seconds + 0.5)
            client_2, redis_2 = used()
            server = (_cpu_s(pids["affinity"]) - before) / rpcs
            client, redis_cpu = (client_2 - client_1) / rpcs, (redis_2 - redis_1) / rpcs
            ratios[tier].append(run.rate * 2 / ceiling_run.rate)
            cpu[tier].append(server / ceiling_cpu)
            parts[tier]["client"].append(client / ceiling_client)
            parts[tier]["redis"].append(redis_cpu / ceiling_redis if ceiling_redis else 0.0)
            parts[tier]["total"].append(
                (server + client + redis_cpu) / (ceiling_cpu + ceiling_client + ceiling_redis)
            )
    print(f"\nPlace hit ÷ the EVALSHA ceiling just before it, {rounds} rounds, order alternating:")
    out: dict[str, object] = {}
    for tier, size in (("small", SMALL), ("big", BIG)):
        print(
            f"  {size} sandboxes: RPCs/s ratio {statistics.median(ratios[tier]):.2f} "
            f"({min(ratios[tier]):.2f}-{max(ratios[tier]):.2f}); server CPU per RPC ÷ the "
            f"ceiling's {statistics.median(cpu[tier]):.2f} "
            f"({min(cpu[tier]):.2f}-{max(cpu[tier]):.2f}); client's "
            f"{statistics.median(parts[tier]['client']):.2f}, Redis's "
            f"{statistics.median(parts[tier]['redis']):.2f}, all three "
            f"{statistics.median(parts[tier]['total']):.2f}"
        )
        out[f"hit_rpc_ratio_alternating_{size}"] = round(statistics.median(ratios[tier]), 2)
        out[f"hit_cpu_per_rpc_over_ceiling_{size}"] = round(statistics.median(cpu[tier]), 2)
        for part in ("client", "redis", "total"):
            out[f"hit_{part}_cpu_per_rpc_over_ceiling_{size}"] = round(
                statistics.median(parts[tier][part]), 2
            )
    return out


async def _bench_security(
    url: str,
    plaintext: str,
    seconds: float,
    concurrency: int,
    procs: list[subprocess.Popen[str]],
    rounds: int,
) -> dict[str, object]:
    """Place hits on plaintext, mTLS and mTLS + authorization servers, in turn."""
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        ensure_local_pki(directory, "turnstile.local", HOLDERS, servers={"affinity"})
        (directory / "policy.toml").write_text(POLICY.read_text())
        addresses = {"plaintext": plaintext}
        secure: list[subprocess.Popen[str]] = []
        for mode in SECURE_MODES:
            proc, addresses[mode] = _start_server(
                f"affinity-{mode}", url, {"BENCH_TLS_DIR": str(directory)}
            )
            procs.append(proc)
            secure.append(proc)
        credentials = tls.channel_credentials(_files(directory, "gateway"))
        channels = {
            mode: grpc.aio.secure_channel(address, credentials)
            if mode != "plaintext"
            else grpc.aio.insecure_channel(address)
            for mode, address in addresses.items()
        }
        runs: dict[tuple[str, int], list[Run]] = {}
        try:
            for _ in range(rounds):
                for n, length in ((concurrency, seconds), (1, seconds / 2)):
                    for mode, channel in channels.items():
                        stub: Any = affinity_pb2_grpc.AffinityServiceStub(channel)
                        run = await _place_turns(stub, "small", n, length, first_turns=False)
                        runs.setdefault((mode, n), []).append(run)
        finally:
            for channel in channels.values():
                await channel.close(None)
            # Before the directory goes: their policy watchers poll the file in it,
            # and would log it invalid once it is removed.
            for proc in secure:
                proc.terminate()
            for proc in secure:
                proc.wait(10)
    print(f"\nPlace hit under transport security (medians over {rounds} interleaved rounds):")
    out: dict[str, object] = {}
    for n in (concurrency, 1):
        plain, mtls, authz = (runs[(m, n)] for m in ("plaintext", *SECURE_MODES))
        tls_ratios = [m.rate / p.rate for m, p in zip(mtls, plain, strict=True)]
        authz_ratios = [a.rate / m.rate for a, m in zip(authz, mtls, strict=True)]
        for name, mode_runs in (("plaintext", plain), ("mTLS", mtls), ("mTLS + authz", authz)):
            rate = statistics.median(r.rate for r in mode_runs)
            p50 = statistics.median(r.pct(0.5) for r in mode_runs)
            print(f"{name + f', {n} in flight':<44} {rate:7.0f}/s  p50 {p50:6.2f} ms")
        print(
            f"  mTLS ÷ plaintext {statistics.median(tls_ratios):.3f} "
            f"({min(tls_ratios):.2f}-{max(tls_ratios):.2f}); "
            f"mTLS + authz ÷ mTLS {statistics.median(authz_ratios):.3f} "
            f"({min(authz_ratios):.2f}-{max(authz_ratios):.2f})"
        )
        out[f"mtls_over_plaintext_{n}"] = round(statistics.median(tls_ratios), 3)
        out[f"authz_over_mtls_{n}"] = round(statistics.median(authz_ratios), 3)
    return out


async def _bench_decision_log(
    url: str,
    logging: str,
    pids: dict[str, int],
    seconds: float,
    concurrency: int,
    procs: list[subprocess.Popen[str]],
    rounds: int,
) -> dict[str, object]:
    """Place hits with the decision log on (the ``logging`` server) and off, in turn."""
    off_proc, off = _start_server("affinity", url, {"TURNSTILE_DECISION_LOG__MAX_ENTRIES": "0"})
    procs.append(off_proc)
    servers = {"on": (logging, pids["affinity"]), "off": (off, off_proc.pid)}
    ratios: dict[str, list[float]] = {"rps": [], "server": [], "total": []}
    for r in range(rounds):
        got: dict[str, tuple[float, float, float]] = {}
        for side in ("on", "off") if r % 2 == 0 else ("off", "on"):
            address, pid = servers[side]
            async with grpc.aio.insecure_channel(address) as channel:
                stub: Any = affinity_pb2_grpc.AffinityServiceStub(channel)
                server_0, redis_0 = _cpu_s(pid), _cpu_s(pids["redis"])
                run = await _place_turns(stub, "small", concurrency, seconds, first_turns=False)
                # The warm-up's 0.5 s runs at the same rate: its RPCs count too.
                rpcs = 2 * run.rate * (seconds + 0.5)
                server = (_cpu_s(pid) - server_0) / rpcs
                redis_cpu = (_cpu_s(pids["redis"]) - redis_0) / rpcs
                got[side] = (run.rate, server, server + redis_cpu)
        ratios["rps"].append(got["on"][0] / got["off"][0])
        ratios["server"].append(got["on"][1] / got["off"][1])
        ratios["total"].append(got["on"][2] / got["off"][2])
    off_proc.terminate()
    off_proc.wait(10)
    out: dict[str, object] = {}
    print(f"\nPlace hit, decision log on ÷ off ({rounds} rounds, order alternating):")
    for name, values in ratios.items():
        median = statistics.median(values)
        print(f"  {name:<7} {median:.3f} ({min(values):.3f}-{max(values):.3f})")
        out[f"decision_log_on_per_off_{name}"] = round(median, 3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="length of each phase")
    parser.add_argument("--concurrency", type=int, default=64, help="calls in flight")
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the security modes (0: skip)"
    )
    parser.add_argument(
        "--serve",
        choices=["echo", "evalsha", "platform", "affinity", "affinity-mtls", "affinity-mtls+authz"],
        help=argparse.SUPPRESS,
    )
    parser.add_argument("--redis", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve and args.serve.startswith("affinity"):
        mode = args.serve.removeprefix("affinity-") if "-" in args.serve else "plaintext"
        uvloop.run(_serve_affinity(args.redis, mode))
    elif args.serve:
        uvloop.run(_serve_ceiling(args.serve, args.redis))
    else:
        uvloop.run(_bench(args.seconds, args.concurrency, args.rounds))


if __name__ == "__main__":
    main()
