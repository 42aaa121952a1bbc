"""Relay benchmark (SPEC F6): N workers attached to one affinity replica.

    uv run python services/affinity/bench/bench_relay.py [--workers 10,1000,5000,10000]
        [--window 15] [--place-seconds 5] [--attestation enforce|off]

For each N, in processes of their own on 127.0.0.1 and against one private
redis-server: an affinity replica (``python -m turnstile_affinity``, default
heartbeat interval and presence ttl, attestation as given) and the load
generator (``attach_load.py streams``: N Attach streams multiplexed over eight
connections, each heartbeating at the Welcome's interval, credentials minted by
the real issuer). Once all N are welcomed and one heartbeat interval has
passed, it measures, over ``--window`` seconds of heartbeats alone:

- the replica's CPU (user + system, from /proc) per 1,000 workers;
- its memory per worker (RSS growth from before the first Hello, ÷ N);
- heartbeat round trip (heartbeat → ack) p50/p99, at the load generator;

then ``Place`` hit throughput (Place + ReleaseLease turns, 64 in flight, one
session per loop, each on an attached worker) and heartbeat p99 during it.
The N = 10 run is the baseline every ratio is against. The machine's other
load is printed with the results: on a shared 2-core host, compare ratios
within one run rather than absolute figures across runs.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from turnstile_contracts import affinity_pb2, affinity_pb2_grpc
from turnstile_platform.sandbox_credentials import generate_key_pair
from turnstile_testing.processes import RedisProcess, free_port

LOAD = Path(__file__).with_name("attach_load.py")
TICK = os.sysconf("SC_CLK_TCK")
PAGE = os.sysconf("SC_PAGE_SIZE")


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime + stime


def _rss_bytes(pid: int) -> int:
    return int(Path(f"/proc/{pid}/statm").read_text().split()[1]) * PAGE


def _loadavg() -> str:
    return Path("/proc/loadavg").read_text().strip()


@dataclass
class Result:
    workers: int
    attach_s: float
    cpu_cores: float
    cpu_per_1000: float
    rss_mb: float
    kb_per_worker: float
    heartbeat_p50_ms: float
    heartbeat_p99_ms: float
    heartbeats: int
    heartbeat_errors: int
    place_turns_per_s: float
    place_p99_ms: float
    heartbeat_p99_during_place_ms: float


class LoadGenerator:
    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc

    async def line(self, timeout: float = 600) -> dict[str, Any]:
        assert self.proc.stdout is not None
        raw = await asyncio.wait_for(self.proc.stdout.readline(), timeout)
        if not raw:
            raise RuntimeError("the load generator exited")
        record: dict[str, Any] = json.loads(raw)
        return record

    async def send(self, command: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{command}\n".encode())
        await self.proc.stdin.drain()

    async def report(self) -> dict[str, Any]:
        await self.send("report")
        return await self.line()

    async def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        try:
            await asyncio.wait_for(self.proc.wait(), 60)
        except TimeoutError:
            self.proc.kill()
            await self.proc.wait()


async def _place_turns(address: str, sandbox_ids: list[str], seconds: float) -> tuple[float, float]:
    """(turns/s, Place p99 ms) of Place hits + ReleaseLease, 64 loops."""
    async with grpc.aio.insecure_channel(address) as channel:
        stub = affinity_pb2_grpc.AffinityServiceStub(channel)
        sessions = [f"bench-session-{i}" for i in range(64)]
        for session in sessions:  # first turns: the timed ones are hits
            placed = await stub.Place(
                affinity_pb2.PlaceRequest(client_id="acme", session_id=session)
            )
            await stub.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(
                    sandbox_id=placed.sandbox_id, lease_id=placed.lease_id
                )
            )
            assert placed.sandbox_id in sandbox_ids
        latencies: list[float] = []
        deadline = time.perf_counter() + seconds

        async def loop(session: str) -> None:
            while time.perf_counter() < deadline:
                t = time.perf_counter()
                placed = await stub.Place(
                    affinity_pb2.PlaceRequest(client_id="acme", session_id=session)
                )
                latencies.append((time.perf_counter() - t) * 1000)
                assert placed.outcome == affinity_pb2.PLACEMENT_OUTCOME_HIT
                await stub.ReleaseLease(
                    affinity_pb2.ReleaseLeaseRequest(
                        sandbox_id=placed.sandbox_id, lease_id=placed.lease_id
                    )
                )

        started = time.perf_counter()
        await asyncio.gather(*(loop(s) for s in sessions))
        elapsed = time.perf_counter() - started
    ordered = sorted(latencies)
    return len(ordered) / elapsed, ordered[int(0.99 * (len(ordered) - 1))]


async def _run(n: int, args: argparse.Namespace, redis_url: str, keys: Path) -> Result:
    port = free_port()
    prefix = f"relaybench{n}:"
    env = {
        **os.environ,
        "TURNSTILE_PORT": str(port),
        "TURNSTILE_METRICS_PORT": "0",
        "TURNSTILE_REDIS_URL": redis_url,
        "TURNSTILE_REDIS_PREFIX": prefix,
        "TURNSTILE_WAKE_ENABLED": "false",
        "TURNSTILE_LOG_LEVEL": "WARNING",
        "TURNSTILE_WORKER_ATTESTATION": args.attestation,
        "TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE": str(keys / "public.pem"),
        "OTEL_TRACES_EXPORTER": "none",
    }
    server = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "turnstile_affinity", env=env, stdout=subprocess.DEVNULL
    )
    address = f"127.0.0.1:{port}"
    try:
        async with grpc.aio.insecure_channel(address) as probe:
            await asyncio.wait_for(probe.channel_ready(), 60)
        rss_before = _rss_bytes(server.pid)
        command = [
            sys.executable,
            str(LOAD),
            "streams",
            "--target",
            address,
            "--count",
            str(n),
            "--channels",
            str(min(8, max(1, n // 100))),
        ]
        if args.attestation == "off":
            command.append("--no-credentials")
        else:
            command += [
                "--signing-key",
                str(keys / "signing.pem"),
                "--redis-url",
                redis_url,
                "--redis-prefix",
                prefix,
            ]
        started = time.perf_counter()
        load = LoadGenerator(
            await asyncio.create_subprocess_exec(
                *command, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE
            )
        )
        try:
            await load.line()  # {"attached": n}
            attach_s = time.perf_counter() - started
            await asyncio.sleep(5.0)  # one default heartbeat interval: every phase running
            await load.send("reset")
            cpu0, t0 = _cpu_s(server.pid), time.perf_counter()
            await asyncio.sleep(args.window)
            cpu = (_cpu_s(server.pid) - cpu0) / (time.perf_counter() - t0)
            rss = _rss_bytes(server.pid)
            beats = await load.report()
            await load.send("reset")
            ids = [f"bench-{i}" for i in range(n)]
            turns, place_p99 = await _place_turns(address, ids, args.place_seconds)
            during = await load.report()
        finally:
            await load.close()
    finally:
        server.terminate()
        await server.wait()
    return Result(
        workers=n,
        attach_s=round(attach_s, 1),
        cpu_cores=round(cpu, 3),
        cpu_per_1000=round(cpu / (n / 1000), 3),
        rss_mb=round(rss / 2**20, 1),
        kb_per_worker=round((rss - rss_before) / n / 1024, 2),
        heartbeat_p50_ms=beats["p50_ms"],
        heartbeat_p99_ms=beats["p99_ms"],
        heartbeats=beats["heartbeats"],
        heartbeat_errors=beats["errors"] + beats["ended"],
        place_turns_per_s=round(turns, 1),
        place_p99_ms=round(place_p99, 2),
        heartbeat_p99_during_place_ms=during["p99_ms"],
    )


async def _main(args: argparse.Namespace) -> None:
    redis = RedisProcess().start()
    keys = Path(tempfile.mkdtemp(prefix="relay-bench-keys-"))
    generate_key_pair(keys / "signing.pem", keys / "public.pem")
    print(f"load average before: {_loadavg()}", flush=True)
    results: list[Result] = []
    try:
        for n in [int(x) for x in args.workers.split(",")]:
            result = await _run(n, args, redis.url, keys)
            results.append(result)
            print(json.dumps(asdict(result)), flush=True)
    finally:
        redis.close()
    print(f"load average after: {_loadavg()}", flush=True)
    base = results[0]
    print(
        f"\n{'workers':>8} {'attach s':>9} {'CPU/1k':>7} {'KB/wkr':>7} {'hb p99':>7} "
        f"{'Place/s':>8} {'ratio':>6} {'Place p99':>9} {'hb p99 (Place)':>14}"
    )
    for r in results:
        print(
            f"{r.workers:>8} {r.attach_s:>9} {r.cpu_per_1000:>7} {r.kb_per_worker:>7} "
            f"{r.heartbeat_p99_ms:>7} {r.place_turns_per_s:>8} "
            f"{r.place_turns_per_s / base.place_turns_per_s:>6.2f} {r.place_p99_ms:>9} "
            f"{r.heartbeat_p99_during_place_ms:>14}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", default="10,1000,5000,10000")
    parser.add_argument("--window", type=float, default=15.0)
    parser.add_argument("--place-seconds", type=float, default=5.0)
    parser.add_argument("--attestation", choices=["enforce", "off"], default="enforce")
    asyncio.run(_main(parser.parse_args()))


if __name__ == "__main__":
    main()
