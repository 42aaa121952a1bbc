"""Health follows its components: a dependency going down flips the server to
NOT_SERVING, and its return flips it back (SPEC X3)."""

from __future__ import annotations

import asyncio

import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_platform.health import HealthMonitor
from turnstile_platform.redis_client import create_redis
from turnstile_platform.server import GrpcService
from turnstile_testing.probe import settings
from turnstile_testing.processes import RedisProcess

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


async def _next_status(stream: object, want: int) -> None:
    while True:
        response = await stream.read()  # type: ignore[attr-defined]
        if response.status == want:
            return


async def test_redis_down_flips_health_and_its_return_restores_it(
    private_redis: RedisProcess,
) -> None:
    app = GrpcService("probe", settings(), service_names=["test.Probe"])
    client = create_redis(private_redis.url, timeout_s=0.2)
    monitor = HealthMonitor(app.health, interval_s=0.05, timeout_s=0.2)

    async def redis_ok() -> bool:
        return bool(await client.ping())

    monitor.add("redis", redis_ok)
    await monitor.start()
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            watch = health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(service="test.Probe")
            )
            await asyncio.wait_for(_next_status(watch, SERVING), 5)
            private_redis.stop()
            await asyncio.wait_for(_next_status(watch, NOT_SERVING), 5)
            private_redis.start()
            await asyncio.wait_for(_next_status(watch, SERVING), 5)
            watch.cancel()
    finally:
        await monitor.stop()
        await client.aclose()
        await app.stop()


async def test_an_unhealthy_component_keeps_readiness_down_but_liveness_up() -> None:
    app = GrpcService("probe", settings(), service_names=[])
    app.health.register("reflector")
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            check = await stub.Check(health_pb2.HealthCheckRequest())
            assert check.status == NOT_SERVING
            liveness = await stub.Check(health_pb2.HealthCheckRequest(service="liveness"))
            assert liveness.status == SERVING
            await app.health.set("reflector", True)
            check = await stub.Check(health_pb2.HealthCheckRequest())
            assert check.status == SERVING
    finally:
        await app.stop()


async def test_each_component_has_a_health_name_and_a_report_only_one_keeps_readiness_up() -> None:
    app = GrpcService("probe", settings(), service_names=["test.Probe"])
    app.health.register("postgres", healthy=True)
    app.health.register("redis", readiness=False)
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)

            async def status(service: str) -> int:
                answer = await stub.Check(health_pb2.HealthCheckRequest(service=service))
                return int(answer.status)

            assert await status("redis") == NOT_SERVING  # reported...
            assert await status("") == SERVING  # ...but not in readiness
            assert await status("test.Probe") == SERVING
            assert await status("postgres") == SERVING
            await app.health.set("postgres", False)
            assert await status("postgres") == NOT_SERVING
            assert await status("") == NOT_SERVING  # a readiness component
            await app.health.set("redis", True)
            assert await status("redis") == SERVING
    finally:
        await app.stop()
