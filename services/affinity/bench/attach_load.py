"""A load generator of attached workers, in a process of its own (SPEC F6).

    python attach_load.py streams --target HOST:PORT --count N [--channels 8]
        [--signing-key PEM --redis-url URL --redis-prefix P | --no-credentials]
    python attach_load.py agents --target TARGET --credentials-dir DIR --count N
        [--reconnect-initial S --reconnect-max S]

``streams`` (the benchmark): N raw ``Attach`` streams multiplexed over a few
channels (each its own connection), each heartbeating at the interval its
Welcome names, starting at a random phase so heartbeats arrive evenly. It mints
each worker's sandbox credential the way the substrate does (the real issuer
writing the real Redis record), unless ``--no-credentials`` (the relay then runs
with attestation off). It prints ``{"attached": N}`` once every stream is
welcomed; then, on stdin, ``reset`` clears the heartbeat statistics and
``report`` prints them (round-trip p50/p99 of heartbeat → ack, counts) as one
JSON line. It exits at the end of stdin.

``agents`` (the replica tests): N real worker agents (``WorkerAgent``), sandbox
ids ``w0…``, each reading its credential from ``DIR/<id>.credential``, all
against ``TARGET`` (e.g. ``ipv4:127.0.0.1:p1,127.0.0.1:p2``: each agent picks
an address at random, as it would among a headless Service's). It prints
``{"attached": a, "welcomes": w}`` whenever either changes, and stops the agents
(Goodbye) at the end of stdin.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import redis.asyncio as aioredis

from turnstile_affinity.worker.agent import WorkerAgent
from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_contracts import affinity_pb2, affinity_pb2_grpc
from turnstile_platform.sandbox_credentials import CredentialIssuer, PresenceClaims, SigningKey
from turnstile_platform.tiers import TIER_LABEL

Call = grpc.aio.StreamStreamCall[affinity_pb2.AttachRequest, affinity_pb2.AttachResponse]


def _emit(record: dict[str, Any]) -> None:
    print(json.dumps(record), flush=True)


async def _stdin_lines() -> asyncio.StreamReader:
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    return reader


# streams ----------------------------------------------------------------------------


class Stats:
    def __init__(self) -> None:
        self.rtts_ms: list[float] = []
        self.errors = 0
        self.ended = 0

    def report(self, attached: int) -> dict[str, Any]:
        ordered = sorted(self.rtts_ms)

        def pct(q: float) -> float:
            return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0.0

        return {
            "attached": attached,
            "heartbeats": len(ordered),
            "p50_ms": round(pct(0.5), 2),
            "p99_ms": round(pct(0.99), 2),
            "max_ms": round(ordered[-1], 2) if ordered else 0.0,
            "errors": self.errors,
            "ended": self.ended,
        }


class NotWelcomedError(Exception):
    """The stream ended without a Welcome."""


async def _one_stream(
    stub: affinity_pb2_grpc.AffinityServiceAsyncStub,
    sandbox_id: str,
    credential: str,
    stats: Stats,
    welcomed: asyncio.Semaphore,
    stop: asyncio.Event,
) -> None:
    """Attach, heartbeat until stopped; like a worker, attach again (full jitter)
    when the relay refuses or ends the stream."""
    hello = affinity_pb2.Hello(
        sandbox_id=sandbox_id, capacity=1024, labels={TIER_LABEL: "bench"}, credential=credential
    )
    beat = affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat())
    first_welcome = True
    window = 1.0
    while not stop.is_set():
        call: Call = stub.Attach(None)
        try:
            await call.write(affinity_pb2.AttachRequest(hello=hello))
            first = await call.read()
            if not isinstance(first, affinity_pb2.AttachResponse) or not first.HasField("welcome"):
                raise NotWelcomedError(sandbox_id)
            interval = first.welcome.heartbeat_interval.ToTimedelta().total_seconds()
            window = 1.0
            if first_welcome:
                first_welcome = False
                welcomed.release()
            await asyncio.sleep(random.uniform(0, interval))  # an even phase over the interval
            while not stop.is_set():
                started = time.perf_counter()
                await call.write(beat)
                ack = await call.read()
                if not isinstance(ack, affinity_pb2.AttachResponse):
                    stats.ended += 1
                    break
                stats.rtts_ms.append((time.perf_counter() - started) * 1000)
                await asyncio.sleep(max(0.0, interval - (time.perf_counter() - started)))
        except (grpc.aio.AioRpcError, NotWelcomedError):
            stats.errors += 1
        finally:
            call.cancel()
        await asyncio.sleep(random.uniform(0, window))
        window = min(window * 2, 10.0)


async def _streams(args: argparse.Namespace) -> None:
    ids = [f"{args.prefix}{i}" for i in range(args.count)]
    credentials = dict.fromkeys(ids, "")
    if not args.no_credentials:
        redis = aioredis.Redis.from_url(args.redis_url)
        issuer = CredentialIssuer(
            SigningKey.from_file(Path(args.signing_key)), redis, args.redis_prefix, ttl_s=86_400
        )
        for start in range(0, len(ids), 50):
            batch = ids[start : start + 50]
            # What the substrate would attest: acme's sandboxes, as the Hello says (SPEC O3).
            presence = PresenceClaims("acme", "bench", 1024, "")
            issued = await asyncio.gather(*(issuer.issue(i, presence=presence) for i in batch))
            credentials.update({i: c.credential for i, c in zip(batch, issued, strict=True)})
        await redis.aclose()
    channels = [
        grpc.aio.insecure_channel(args.target, options=[("grpc.use_local_subchannel_pool", 1)])
        for _ in range(args.channels)
    ]
    stubs = [affinity_pb2_grpc.AffinityServiceStub(c) for c in channels]
    stats = Stats()
    stop = asyncio.Event()
    welcomed = asyncio.Semaphore(0)
    tasks = []
    for n, sandbox_id in enumerate(ids):
        tasks.append(
            asyncio.create_task(
                _one_stream(
                    stubs[n % len(stubs)],
                    sandbox_id,
                    credentials[sandbox_id],
                    stats,
                    welcomed,
                    stop,
                )
            )
        )
        if n % 200 == 199:  # attach in waves, as workers of a fleet would
            await asyncio.sleep(0.05)
    for _ in ids:
        await welcomed.acquire()
    _emit({"attached": len(ids)})
    lines = await _stdin_lines()
    while line := await lines.readline():
        command = line.decode().strip()
        if command == "reset":
            stats = _reset(stats)
        elif command == "report":
            _emit(stats.report(sum(1 for t in tasks if not t.done())))
    stop.set()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    for channel in channels:
        await channel.close(None)


def _reset(stats: Stats) -> Stats:
    stats.rtts_ms.clear()
    stats.errors = 0
    stats.ended = 0
    return stats


# agents -----------------------------------------------------------------------------


async def _agents(args: argparse.Namespace) -> None:
    directory = Path(args.credentials_dir)
    agents = [
        WorkerAgent(
            WorkerSettings(
                sandbox_id=f"{args.prefix}{i}",
                capacity=4,
                tier="a",
                affinity_addr=args.target,
                credential_file=directory / f"{args.prefix}{i}.credential",
                reconnect_initial_s=args.reconnect_initial,
                reconnect_max_s=args.reconnect_max,
                keepalive_time_s=30,
            )
        )
        for i in range(args.count)
    ]
    changed = asyncio.Event()

    async def watch(agent: WorkerAgent) -> None:
        while True:
            await agent.attached.wait()
            changed.set()
            await agent.welcomed(agent.welcomes + 1)
            changed.set()

    running = [asyncio.create_task(a.run()) for a in agents]
    watchers = [asyncio.create_task(watch(a)) for a in agents]

    async def reporter() -> None:
        last: tuple[int, int] | None = None
        while True:
            await changed.wait()
            changed.clear()
            await asyncio.sleep(0.05)  # coalesce a burst of changes into one line
            now = (sum(a.attached.is_set() for a in agents), sum(a.welcomes for a in agents))
            if now != last:
                _emit({"attached": now[0], "welcomes": now[1]})
                last = now

    report = asyncio.create_task(reporter())

    async def detached_watch() -> None:
        # A stream that ends clears ``attached`` without an event: look now and then.
        while True:
            await asyncio.sleep(0.1)
            changed.set()

    poll = asyncio.create_task(detached_watch())
    lines = await _stdin_lines()
    while await lines.readline():
        pass
    for agent in agents:
        agent.stop.set()
    await asyncio.gather(*running, return_exceptions=True)
    for task in (*watchers, report, poll):
        task.cancel()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="mode", required=True)
    streams = sub.add_parser("streams")
    streams.add_argument("--target", required=True)
    streams.add_argument("--count", type=int, required=True)
    streams.add_argument("--channels", type=int, default=8)
    streams.add_argument("--prefix", default="bench-")
    streams.add_argument("--signing-key")
    streams.add_argument("--redis-url")
    streams.add_argument("--redis-prefix")
    streams.add_argument("--no-credentials", action="store_true")
    agents = sub.add_parser("agents")
    agents.add_argument("--target", required=True)
    agents.add_argument("--count", type=int, required=True)
    agents.add_argument("--prefix", default="w")
    agents.add_argument("--credentials-dir", required=True)
    agents.add_argument("--reconnect-initial", type=float, default=1.0)
    agents.add_argument("--reconnect-max", type=float, default=10.0)
    args = parser.parse_args()
    asyncio.run(_streams(args) if args.mode == "streams" else _agents(args))


if __name__ == "__main__":
    main()
