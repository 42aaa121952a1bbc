"""What returning a connection to the pool costs the already-running Activate: the pool as
built (no reset query on release unless the connection holds session state) against
asyncpg's default (its reset query on every release, a second PostgreSQL round trip per
borrow), alternated in one process.

    uv run python services/substrate/bench/activate_release.py [--database-url URL] [--rounds N]

Two substrate services (Direct, idle runtimes) run side by side in this process on one
scratch database, each with 16 running sandboxes of its own; they differ only in the
pool's ``reset``. Each round measures both, the order flipped every round, on:

* 64 in flight: calls/s, this process's CPU per call (client and both services:
  the idle one costs the same in either phase), and the CPU per call of the
  measured pool's PostgreSQL backends (``/proc/<pid>/stat``; PostgreSQL is local);
* one in flight: the median latency of a call;

then, without gRPC, this process's CPU per borrow of a one-connection pool of each kind
(acquire, one primary-key ``fetchrow``, release), alternated the same way.

Absolute figures move with the machine's load; the ratios of the two pools within a round
are what it reports (median and range over the rounds), with the load average.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc.aio

from turnstile_contracts import admission_pb2_grpc, common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform import postgres
from turnstile_platform.server import GrpcService
from turnstile_substrate.app import create_app
from turnstile_substrate.db import pool as substrate_pool
from turnstile_substrate.db.migrate import apply_migrations

sys.path.insert(0, str(Path(__file__).parent))
from activate import AdmitAll, bench_settings, rate  # the sibling benchmark

IN_FLIGHT = 64
SANDBOXES = 16
CALLS = 4000
SEQUENTIAL = 600
TICK_S = 1 / os.sysconf("SC_CLK_TCK")


@dataclass
class Variant:
    name: str
    application_name: str
    prefix: str
    app: GrpcService | None = None
    stub: Any = None
    channel: grpc.aio.Channel | None = None
    #: The Direct substrate's state directory (its runtimes' records).
    state_dir: Path | None = None


@dataclass
class Sample:
    rate: float
    cpu_us: float
    pg_cpu_us: float
    p50_us: float


async def default_reset_pool(*args: Any, **kwargs: Any) -> postgres.BoundedPool:
    """The substrate's pool with asyncpg's own reset on every release."""
    kwargs.update(reset=None, application_name="bench-default-reset")
    return await postgres.create_pool(*args, **kwargs)


def backend_cpu_s(pids: list[int]) -> float:
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as stat:
            fields = stat.read().rpartition(")")[2].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total * TICK_S


async def measure(variant: Variant, admin: asyncpg.Connection, database: str) -> Sample:
    client = common_pb2.ActivationClient(client_id="acme")
    requests = [
        substrate_pb2.ActivateRequest(sandbox_id=f"{variant.prefix}-{i}", client=client)
        for i in range(SANDBOXES)
    ]

    async def call(i: int) -> None:
        await variant.stub.Activate(requests[i % SANDBOXES])

    pids = [
        row["pid"]
        for row in await admin.fetch(
            "SELECT pid FROM pg_stat_activity WHERE datname = $1 AND application_name = $2",
            database,
            variant.application_name,
        )
    ]
    pg_before = backend_cpu_s(pids)
    cpu_before = time.process_time()
    calls_per_s = await rate(call, CALLS, IN_FLIGHT)
    cpu = time.process_time() - cpu_before
    pg_cpu = backend_cpu_s(pids) - pg_before

    latencies = []
    for i in range(SEQUENTIAL):
        started = time.perf_counter()
        await call(i)
        latencies.append(time.perf_counter() - started)
    return Sample(
        calls_per_s,
        cpu / CALLS * 1e6,
        pg_cpu / CALLS * 1e6,
        statistics.median(latencies) * 1e6,
    )


MEASURES: dict[str, Callable[[Sample], float]] = {
    "calls/s, 64 in flight": lambda s: s.rate,
    "process CPU µs/call": lambda s: s.cpu_us,
    "PostgreSQL CPU µs/call": lambda s: s.pg_cpu_us,
    "sequential p50 µs": lambda s: s.p50_us,
}


def spread(values: list[float], digits: int = 3) -> str:
    return (
        f"{statistics.median(values):.{digits}f} "
        f"({min(values):.{digits}f}–{max(values):.{digits}f})"
    )


_pools: dict[str, postgres.BoundedPool] = {}


async def borrow_cpu_us(variant: Variant, url: str, borrows: int = 3000) -> float:
    """This process's CPU per borrow of a pool built as the variant's is, one at a time:
    the client side of the release alone, without gRPC around it."""
    pool = _pools.get(variant.name)
    if pool is None:
        pool = await postgres.create_pool(
            url,
            guard=postgres.postgres_guard(5.0),
            min_size=1,
            max_size=1,
            application_name=f"bench-borrow-{variant.prefix}",
            **({"reset": None} if variant.prefix == "b" else {}),
        )
        _pools[variant.name] = pool
    query = "SELECT id FROM sandboxes WHERE id = $1"
    started = time.process_time()
    for _ in range(borrows):
        async with pool.acquire() as conn:
            await conn.fetchrow(query, "a-0")
    return (time.process_time() - started) / borrows * 1e6


async def main(database_url: str, rounds: int) -> None:
    base, _, _ = database_url.rpartition("/")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = f"{base}/{name}"
    admission = grpc.aio.server()
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(AdmitAll(), admission)
    admission_port = admission.add_insecure_port("127.0.0.1:0")
    await admission.start()
    variants = [
        Variant("no reset query", "turnstile-substrate", "a"),
        Variant("asyncpg reset", "bench-default-reset", "b"),
    ]
    try:
        await asyncio.to_thread(apply_migrations, url)
        for variant in variants:
            variant.state_dir = Path(tempfile.mkdtemp(prefix="turnstile-bench-"))
            settings = bench_settings(url, admission_port, variant.state_dir)
            # The pool module's name for the platform's create_pool, swapped for the
            # old variant while its app is made (the name is not re-exported).
            original = getattr(substrate_pool, "create_bounded_pool")  # noqa: B009
            if variant.prefix == "b":
                setattr(substrate_pool, "create_bounded_pool", default_reset_pool)  # noqa: B010
            try:
                variant.app = await create_app(settings)
            finally:
                setattr(substrate_pool, "create_bounded_pool", original)  # noqa: B010
            await variant.app.start()
            variant.channel = grpc.aio.insecure_channel(variant.app.address)
            variant.stub = substrate_pb2_grpc.SubstrateServiceStub(variant.channel)
            client = common_pb2.ActivationClient(client_id="acme")
            for i in range(SANDBOXES):
                await variant.stub.Activate(
                    substrate_pb2.ActivateRequest(sandbox_id=f"{variant.prefix}-{i}", client=client)
                )
            await measure(variant, admin, name)  # warm-up: every connection, every statement

        samples: dict[str, list[Sample]] = {v.name: [] for v in variants}
        loads = [os.getloadavg()[0]]
        for round_ in range(rounds):
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                samples[variant.name].append(await measure(variant, admin, name))
            loads.append(os.getloadavg()[0])

        new, old = (samples[v.name] for v in variants)
        print(f"{rounds} rounds, load average (1 min) {min(loads):.1f}–{max(loads):.1f}")
        print("Activate, already running: median (min–max) over the rounds, new | asyncpg reset")
        for label, value in MEASURES.items():
            a = [value(sample) for sample in new]
            b = [value(sample) for sample in old]
            ratios = [x / y for x, y in zip(a, b, strict=True)]
            print(f"  {label:24} {spread(a, 0):>18} | {spread(b, 0):>18}   ratio {spread(ratios)}")

        loads = [os.getloadavg()[0]]
        borrows: dict[str, list[float]] = {v.name: [] for v in variants}
        for round_ in range(rounds * 2):
            for variant in variants if round_ % 2 == 0 else variants[::-1]:
                borrows[variant.name].append(await borrow_cpu_us(variant, url))
        loads.append(os.getloadavg()[0])
        a, b = (borrows[v.name] for v in variants)
        print(
            f"one borrow (acquire, primary-key fetchrow, release), sequential, process CPU µs, "
            f"{rounds * 2} rounds, load {min(loads):.1f}–{max(loads):.1f}:\n"
            f"  new {spread(a, 1)} | asyncpg reset {spread(b, 1)}   "
            f"difference {spread([x - y for x, y in zip(a, b, strict=True)], 1)}   "
            f"ratio {spread([x / y for x, y in zip(a, b, strict=True)])}"
        )
    finally:
        for variant in variants:
            if variant.stub is not None:
                # The runtimes outlive the substrate by design (Direct adopts them
                # on restart): stop them, or every run leaves its sandboxes running.
                await asyncio.gather(
                    *(
                        variant.stub.Deactivate(
                            substrate_pb2.DeactivateRequest(sandbox_id=f"{variant.prefix}-{i}")
                        )
                        for i in range(SANDBOXES)
                    ),
                    return_exceptions=True,
                )
            if variant.channel is not None:
                await variant.channel.close(None)
            if variant.app is not None:
                await variant.app.stop()
            if variant.state_dir is not None:
                shutil.rmtree(variant.state_dir, ignore_errors=True)
        for pool in _pools.values():
            await pool.close()
        await admission.stop(None)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--rounds", type=int, default=6)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.database_url, arguments.rounds))
