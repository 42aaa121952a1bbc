"""The platform's servers serve every method through generic handlers only.

grpcio's aio server keeps one pending request-call task per registered method
(``AioServer._request_registered_call``) plus one for generic methods
(``AioServer._request_call``), and its main loop waits on all of them for every
call (:mod:`turnstile_platform.generic_server`). Those tasks are visible through
:func:`asyncio.all_tasks`, so the tests count them: a registered method that
slipped in, by any path, adds one. The control test shows the count does see
registered methods on a plain grpc.aio server.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, TypeAlias

import grpc
import grpc.aio
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_contracts import admission_pb2, admission_pb2_grpc
from turnstile_platform import generic_server
from turnstile_platform.health import HealthMap
from turnstile_platform.server import GrpcService
from turnstile_testing.probe import settings
from turnstile_testing.processes import free_port

ADMISSION = admission_pb2.DESCRIPTOR.services_by_name["AdmissionService"].full_name
HEALTH_METHODS = len(health_pb2.DESCRIPTOR.services_by_name["Health"].methods)
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"


def pending_request_calls() -> Counter[str]:
    """grpcio's pending request-call tasks in this loop, by kind."""
    kinds = {"_request_registered_call": "registered", "_request_call": "generic"}
    names = (getattr(task.get_coro(), "__name__", "") for task in asyncio.all_tasks())
    return Counter(kinds[name] for name in names if name in kinds)


class Usage(admission_pb2_grpc.AdmissionServiceServicer):
    """Answers GetUsage with a recognisable figure; the rest stay unimplemented."""

    async def GetUsage(
        self, request: admission_pb2.GetUsageRequest, context: object
    ) -> admission_pb2.GetUsageResponse:
        return admission_pb2.GetUsageResponse(pending=7)


async def test_the_platform_servers_serve_everything_with_no_registered_method() -> None:
    app = GrpcService("generic-test", settings(health_port=free_port()), service_names=[ADMISSION])
    usage = Usage()  # type: ignore[abstract]  # only GetUsage is called
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(usage, app.server)
    await app.start()
    try:
        async with grpc.aio.insecure_channel(app.address) as channel:
            answer = await admission_pb2_grpc.AdmissionServiceStub(channel).GetUsage(
                admission_pb2.GetUsageRequest(), timeout=10
            )
            assert answer.pending == 7
            checked = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(service=ADMISSION), timeout=10
            )
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.health_port}") as channel:
            checked = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert checked.status == health_pb2.HealthCheckResponse.SERVING
        # One generic request-call per server (main and health-only), nothing else.
        assert pending_request_calls() == Counter(generic=2)
    finally:
        await app.stop()


async def test_the_count_sees_the_registered_methods_of_a_plain_server() -> None:
    server = grpc.aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthMap([]).servicer, server)
    server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        assert pending_request_calls() == Counter(registered=HEALTH_METHODS, generic=1)
    finally:
        await server.stop(None)


class Resolved(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Records the handler grpcio resolves for each call."""

    def __init__(self) -> None:
        self.handlers: list[Handler] = []

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler = await continuation(handler_call_details)
        self.handlers.append(handler)
        return handler


async def test_generic_resolution_returns_the_same_handler_for_each_call() -> None:
    # The platform interceptor keeps each method's wrapper keyed on this identity.
    resolved = Resolved()
    server = generic_server.server(interceptors=[resolved])
    health_pb2_grpc.add_HealthServicer_to_server(HealthMap([]).servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for _ in range(3):
                await stub.Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert len(resolved.handlers) == 3
        assert all(handler is resolved.handlers[0] for handler in resolved.handlers)
        assert pending_request_calls() == Counter(generic=1)
    finally:
        await server.stop(None)
