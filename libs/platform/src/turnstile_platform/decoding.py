"""Undecodable request bytes answered with INVALID_ARGUMENT, in one place, for every RPC.

grpc.aio deserializes a request with the method handler's ``request_deserializer``
before (unary requests) or while (``async for`` over a request stream) the handler
runs. When that raises, grpc.aio answers ``UNKNOWN`` with the exception's class
name in the message and logs a full traceback per call; the ``Attach`` stream's
handler sees the exception mid-iteration and answers ``INTERNAL``. A caller sent
bad bytes: that is ``INVALID_ARGUMENT``, and the log needs one short warning, not
a traceback an attacker can multiply.

:class:`DecodingInterceptor` (the bootstrap installs it innermost, on every
service, health and reflection included) wraps each handler's deserializer so
it returns an :class:`Undecodable` marker instead of raising, and wraps the
handler so the marker is answered with ``INVALID_ARGUMENT`` naming the field
``request`` before any servicer code sees it. The warning is rate-limited per
method (:data:`WARN_INTERVAL_S`) and counts the calls it did not log.
"""

from __future__ import annotations

import inspect
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from prometheus_client import Counter

from turnstile_platform.errors import abort, bad_field

log = logging.getLogger(__name__)

UNDECODABLE = Counter(
    "turnstile_grpc_server_undecodable_requests_total",
    "Requests whose bytes did not decode as the method's request message, by method.",
    ["grpc_service", "grpc_method"],
)

#: At most one warning per method in this many seconds; the rest are counted.
WARN_INTERVAL_S = 60.0
_REASON_CHARS = 120

Handler = Callable[..., Any]


@dataclass(frozen=True)
class Undecodable:
    """What the wrapped deserializer returns for bytes that do not decode."""

    message_type: str
    size: int
    reason: str


class _Warnings:
    """One warning per method per interval; the calls in between are counted."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: dict[str, float] = {}
        self._suppressed: dict[str, int] = {}

    def warn(self, rpc: str, bad: Undecodable) -> None:
        now = time.monotonic()
        with self._lock:
            last = self._last.get(rpc)
            if last is not None and now - last < WARN_INTERVAL_S:
                self._suppressed[rpc] = self._suppressed.get(rpc, 0) + 1
                return
            self._last[rpc] = now
            suppressed = self._suppressed.pop(rpc, 0)
        log.warning(
            "undecodable request answered INVALID_ARGUMENT",
            extra={
                "rpc": rpc,
                "message_type": bad.message_type,
                "bytes": bad.size,
                "reason": bad.reason,
                "suppressed_since_last": suppressed,
            },
        )


_warnings = _Warnings()


def _decoding(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None
    owner = getattr(deserializer, "__self__", None)
    descriptor = getattr(owner, "DESCRIPTOR", None)
    message_type = str(getattr(descriptor, "full_name", "the request message"))

    def decode(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as error:  # protobuf's DecodeError, or anything a parser raises
            reason = f"{type(error).__name__}: {error}"[:_REASON_CHARS]
            return Undecodable(message_type, len(data), reason)

    return decode


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return service, name


async def _refuse(context: grpc.aio.ServicerContext[Any, Any], rpc: str, bad: Undecodable) -> None:
    service, method = _split(rpc)
    UNDECODABLE.labels(service, method).inc()
    _warnings.warn(rpc, bad)
    await abort(
        context,
        bad_field("request", f"the request bytes do not decode as {bad.message_type}"),
    )


class DecodingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Answers undecodable request bytes with INVALID_ARGUMENT on every method."""

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler  # type: ignore[return-value]  # grpc-stubs says never None; it can be
        rpc = handler_call_details.method
        deserializer = _decoding(handler.request_deserializer)
        serializer = handler.response_serializer
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                _unary(handler.unary_unary, rpc),
                request_deserializer=deserializer,
                response_serializer=serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                _unary(handler.unary_stream, rpc),
                request_deserializer=deserializer,
                response_serializer=serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                _streaming(handler.stream_stream, rpc),
                request_deserializer=deserializer,
                response_serializer=serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                _streaming(handler.stream_unary, rpc),
                request_deserializer=deserializer,
                response_serializer=serializer,
            )
        return handler


def _unary(behaviour: Handler, rpc: str) -> Handler:
    """Wraps a handler taking one request: an async generator stays one (grpc.aio
    tells streaming handlers apart by that), a coroutine stays a coroutine."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, Undecodable):
                await _refuse(context, rpc, request)
            async for response in behaviour(request, context):
                yield response

        return stream

    async def call(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        if isinstance(request, Undecodable):
            await _refuse(context, rpc, request)
        return await behaviour(request, context)

    return call


async def _checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any], rpc: str
) -> AsyncIterator[Any]:
    """The request stream, aborting the call at the first undecodable message.

    The abort sends the status at once, so a handler that catches broadly cannot
    turn it into another code.
    """
    async for request in requests:
        if isinstance(request, Undecodable):
            await _refuse(context, rpc, request)
        yield request


def _streaming(behaviour: Handler, rpc: str) -> Handler:
    """Wraps a handler taking a request stream (same generator/coroutine rule)."""
    if inspect.isasyncgenfunction(behaviour):

        async def stream(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            async for response in behaviour(_checked(requests, context, rpc), context):
                yield response

        return stream

    async def call(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        return await behaviour(_checked(requests, context, rpc), context)

    return call
