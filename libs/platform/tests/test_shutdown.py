"""Graceful shutdown: health goes NOT_SERVING on SIGTERM before in-flight calls drain."""

from __future__ import annotations

import asyncio
import os
import signal
import sys

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_testing.probe import call


async def _read_line(stream: asyncio.StreamReader, prefix: str) -> str:
    while True:
        line = (await stream.readline()).decode()
        if not line:
            raise AssertionError(f"process ended before printing {prefix!r}")
        if line.startswith(prefix):
            return line.strip()


async def test_sigterm_flips_health_before_in_flight_calls_drain_then_exits_cleanly() -> None:
    env = {
        **os.environ,
        "TURNSTILE_SHUTDOWN_DRAIN_DELAY_S": "0.5",
        "TURNSTILE_SHUTDOWN_GRACE_S": "10",
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnstile_testing.probe_server",
        stdout=asyncio.subprocess.PIPE,
        env=env,
    )
    assert proc.stdout is not None
    try:
        port = int((await _read_line(proc.stdout, "port=")).split("=")[1])
        events: list[str] = []
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(health_pb2.HealthCheckRequest())
            first = await watch.read()
            assert first.status == health_pb2.HealthCheckResponse.SERVING

            async def watch_health() -> None:
                update = await watch.read()
                assert update.status == health_pb2.HealthCheckResponse.NOT_SERVING
                events.append("not-serving")

            async def slow_call() -> None:
                assert await call(channel, "Slow", b"1.5") == b"slow-done"
                events.append("slow-done")

            watcher = asyncio.create_task(watch_health())
            slow = asyncio.create_task(slow_call())
            await _read_line(proc.stdout, "slow-started")
            proc.send_signal(signal.SIGTERM)
            await asyncio.wait_for(asyncio.gather(watcher, slow), timeout=15)
        assert events == ["not-serving", "slow-done"]
        assert await asyncio.wait_for(proc.wait(), timeout=15) == 0
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
