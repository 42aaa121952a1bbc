"""Server interceptors every service shares: rich errors, RPC metrics, call limits.

The rich-error interceptor lets handlers ``raise RichError(...)`` instead of
threading ``context`` through the domain code; it turns the exception into
``context.abort`` with the packed status. Unexpected exceptions become INTERNAL
with a log line (the message stays generic: internals are not leaked).

Given :class:`~turnstile_platform.call_limits.CallLimits`, it also counts unary
calls and streams against limits of their own and refuses past them (SPEC F6).
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import grpc
import grpc.aio
from prometheus_client import Counter, Histogram

from turnstile_platform.call_limits import CallKind, CallLimits
from turnstile_platform.errors import RichError, abort
from turnstile_platform.metric_children import Children

log = logging.getLogger(__name__)

RPCS = Counter(
    "turnstile_grpc_server_handled_total",
    "RPCs completed, by service, method and status code.",
    ["grpc_service", "grpc_method", "grpc_code"],
)
RPC_SECONDS = Histogram(
    "turnstile_grpc_server_handling_seconds",
    "RPC handling time, by service and method (streams: the whole stream).",
    ["grpc_service", "grpc_method"],
    buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
#: Their children, looked up once per label values (methods and codes are few).
_RPCS = Children(RPCS)
_RPC_SECONDS = Children(RPC_SECONDS)

Handler = Callable[..., Any]


def _split(method: str) -> tuple[str, str]:
    service, _, name = method.lstrip("/").rpartition("/")
    return service, name


class ServerInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Maps :class:`RichError` to a rich status, records RPC metrics, enforces limits.

    Health and reflection pass through uncounted: a replica at its limits still
    answers its probes.
    """

    def __init__(self, limits: CallLimits | None = None) -> None:
        self._limits = limits or CallLimits(unary=1_000_000, streams=1_000_000)

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler is None:
            return None  # type: ignore[return-value]  # grpc-stubs says never None; it can be
        service, method = _split(handler_call_details.method)
        if service.startswith(("grpc.health.", "grpc.reflection.")):
            return handler
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, service, method, self._limits),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None and inspect.isasyncgenfunction(handler.stream_stream):
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(handler.stream_stream, service, method, self._limits),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    @staticmethod
    def _wrap_unary(behaviour: Handler, service: str, method: str, limits: CallLimits) -> Handler:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            async with _handled(context, service, method):
                with limits.slot(CallKind.UNARY, method):
                    return await behaviour(request, context)

        return wrapper

    @staticmethod
    def _wrap_stream(behaviour: Handler, service: str, method: str, limits: CallLimits) -> Handler:
        async def wrapper(
            request_iterator: Any, context: grpc.aio.ServicerContext[Any, Any]
        ) -> Any:
            async with _handled(context, service, method):
                with limits.slot(CallKind.STREAM, method):
                    async for response in behaviour(request_iterator, context):
                        yield response

        return wrapper


@contextlib.asynccontextmanager
async def _handled(
    context: grpc.aio.ServicerContext[Any, Any], service: str, method: str
) -> AsyncIterator[None]:
    """Map what a handler raised to a status, and record the RPC's metrics."""
    started = time.perf_counter()
    code: object = grpc.StatusCode.OK
    try:
        yield
    except RichError as error:
        code = error.code
        await abort(context, error)
    except (grpc.aio.AbortError, grpc.aio.UsageError):
        code = context.code()
        raise
    except asyncio.CancelledError:
        code = grpc.StatusCode.CANCELLED
        raise
    except NotImplementedError:
        code = grpc.StatusCode.UNIMPLEMENTED
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{method} is not implemented")
    except Exception:
        code = grpc.StatusCode.INTERNAL
        log.exception("unhandled error", extra={"rpc": f"{service}/{method}"})
        await context.abort(grpc.StatusCode.INTERNAL, "internal error")
    finally:
        _RPCS(service, method, _code_name(code)).inc()
        _RPC_SECONDS(service, method).observe(time.perf_counter() - started)


def _code_name(code: object) -> str:
    if isinstance(code, grpc.StatusCode):
        return code.name
    return str(code)
