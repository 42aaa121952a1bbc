"""What one Redis Cluster slot sustains for a script: the benchmarks' shared part.

Every key of a service shares one hash tag, so all its scripts run on one slot:
one master, one Redis thread. This drives a private ``redis-server`` with
``redis-benchmark`` (C, pipelined, many connections: Python cannot saturate Redis
on its own) sending one script's EVALSHA, exactly as the service sends it, and a
bare one-key EVALSHA as the ceiling in the same round. Two figures per script:

* calls/s as ``redis-benchmark`` saw them, and their ratio to the bare ceiling of
  the same round (the machine's speed varies; ratios travel better);
* CPU time of Redis's main thread per call (``INFO cpu``, user + system: parsing,
  the script, replies), and the calls/s it implies for one Redis core. On a
  shared machine this is the figure to trust: ``commandstats``' ``usec_per_call``
  is wall time, and counts every moment the server was descheduled mid-script.
"""

from __future__ import annotations

import argparse
import asyncio
import csv
import hashlib
import io
import os
import shutil
import statistics
import subprocess
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import dataclass
from typing import Any

import redis

from turnstile_testing.processes import RedisProcess

BARE = "#!lua\nreturn 1"


@dataclass(frozen=True)
class SlotLoad:
    """One script call, repeated: the full text, and the keys and arguments sent."""

    name: str
    script: str
    keys: Sequence[str]
    args: Sequence[str | int | float]


@dataclass(frozen=True)
class Figure:
    calls_per_s: float
    cpu_us_per_call: float


def _main_thread_cpu_s(client: redis.Redis) -> float:
    cpu = client.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


def bare_load(key: str) -> SlotLoad:
    """The ceiling: an EVALSHA of a script that returns at once, one key of the same tag."""
    return SlotLoad("bare EVALSHA", BARE, [key], [])


def _run_once(port: int, load: SlotLoad, *, requests: int, clients: int, pipeline: int) -> Figure:
    binary = shutil.which("redis-benchmark")
    if binary is None:
        raise RuntimeError("redis-benchmark is not installed (it comes with redis-server)")
    sha = hashlib.sha1(load.script.encode(), usedforsecurity=False).hexdigest()
    with redis.Redis(host="127.0.0.1", port=port) as client:
        client.script_load(load.script)
        client.config_resetstat()
        cpu_before = _main_thread_cpu_s(client)
        out = subprocess.run(
            [
                binary,
                "-p",
                str(port),
                "-n",
                str(requests),
                "-c",
                str(clients),
                "-P",
                str(pipeline),
                "--csv",
                "evalsha",
                sha,
                str(len(load.keys)),
                *load.keys,
                *(str(a) for a in load.args),
            ],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
        cpu_s = _main_thread_cpu_s(client) - cpu_before
        stats = client.info("commandstats")["cmdstat_evalsha"]
    rows = list(csv.DictReader(io.StringIO(out)))
    # redis-benchmark may send a pipeline's worth more than asked: count what ran.
    if stats.get("failed_calls", 0) or stats["calls"] < requests:
        raise RuntimeError(f"{load.name}: {stats}")
    return Figure(float(rows[-1]["rps"]), cpu_s / stats["calls"] * 1e6)


def measure(
    port: int,
    loads: Sequence[SlotLoad],
    *,
    rounds: int = 3,
    requests: int = 20_000,
    clients: int = 16,
    pipeline: int = 16,
) -> dict[str, list[Figure]]:
    """Each load once per round, interleaved, so drift falls on all of them."""
    figures: dict[str, list[Figure]] = {load.name: [] for load in loads}
    for _ in range(rounds):
        for load in loads:
            figures[load.name].append(
                _run_once(port, load, requests=requests, clients=clients, pipeline=pipeline)
            )
    return figures


def report(figures: dict[str, list[Figure]], ceiling: str) -> str:
    """A table: calls/s (median, range), ratio to the ceiling, Redis CPU µs per call
    and the calls/s one Redis core sustains at that cost."""
    base = figures[ceiling]
    lines = [
        f"load average {os.getloadavg()[0]:.1f}; {len(base)} rounds; medians [ranges]",
        f"{'script':<22} {'calls/s':>22} {'÷ bare':>18} {'Redis CPU µs/call':>20} {'1 core':>10}",
    ]
    for name, runs in figures.items():
        rps = [f.calls_per_s for f in runs]
        ratios = [f.calls_per_s / b.calls_per_s for f, b in zip(runs, base, strict=True)]
        usec = [f.cpu_us_per_call for f in runs]
        lines.append(
            f"{name:<22} {statistics.median(rps):>9,.0f} [{min(rps):,.0f}–{max(rps):,.0f}]"
            f" {statistics.median(ratios):>6.2f} [{min(ratios):.2f}–{max(ratios):.2f}]"
            f" {statistics.median(usec):>9.1f} [{min(usec):.1f}–{max(usec):.1f}]"
            f" {1e6 / statistics.median(usec):>10,.0f}"
        )
    return "\n".join(lines)


def main(
    description: str, prepare: Callable[[int], Coroutine[Any, Any, SlotLoad]], bare_key: str
) -> None:
    """A slot benchmark's command line: a private redis-server, ``prepare(port)`` to
    set the state up and say what to replay, then the table against ``bare_key``'s
    bare EVALSHA (a key of the same tag)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=20_000, help="per load and round")
    options = parser.parse_args()
    server = RedisProcess().start()
    try:
        load = asyncio.run(prepare(server.port))
        bare = bare_load(bare_key)
        figures = measure(
            server.port, [bare, load], rounds=options.rounds, requests=options.requests
        )
        print(report(figures, bare.name))
    finally:
        server.close()
