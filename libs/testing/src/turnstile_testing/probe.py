"""A tiny byte-level gRPC service (``test.Probe``) hosted on the real bootstrap."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

import grpc
import grpc.aio

from turnstile_platform.server import GrpcService
from turnstile_platform.settings import ServiceSettings

SERVICE = "test.Probe"
UnaryBehaviour = Callable[[bytes, grpc.aio.ServicerContext[Any, Any]], Awaitable[bytes]]


def add_probe(app: GrpcService, methods: dict[str, UnaryBehaviour]) -> None:
    handlers = {name: grpc.unary_unary_rpc_method_handler(fn) for name, fn in methods.items()}
    app.server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))


def settings(**overrides: Any) -> ServiceSettings:
    return ServiceSettings(port=0, shutdown_grace_s=5, **overrides)


async def call(channel: grpc.aio.Channel, method: str, payload: bytes = b"") -> bytes:
    callable_ = channel.unary_unary(f"/{SERVICE}/{method}", None, None)
    result: bytes = await callable_(payload)
    return result
