"""The one server interceptor every service runs: tracing, limits, authorization,
undecodable requests, rich errors and RPC metrics, in one wrapper per method.

Each call, in order: its server span starts; the
:class:`~turnstile_platform.authz.authorizer.Authorizer` checks that its identity
may call the method; it takes a seat of its kind from
:class:`~turnstile_platform.call_limits.CallLimits` for its flow and level
(:mod:`turnstile_platform.flows`), waiting briefly in its flow's queue or refused
``RESOURCE_EXHAUSTED`` (SPEC F6, O6, N1); the authorizer checks the clients it acts
for; an undecodable request is answered ``INVALID_ARGUMENT``; the handler runs, and a
:class:`RichError` becomes its rich status, a failing dependency ``UNAVAILABLE``
with the service's retry hint (:func:`~turnstile_platform.errors.dependency_error`,
the one place that answer is built), anything unexpected a generic ``INTERNAL``
(logged with its traceback once a minute per method and error type, the rest
counted); then the seat is freed, the RPC counted and timed, the span ended. Health
and reflection skip the span, the seat and (health) authorization.

Why one interceptor: grpc.aio runs every interceptor's ``intercept_service`` on
every call, each rebuilding the handler (docs/performance.md). Here a method's
wrapped handler is built on its first call and kept, keyed by the identity of the
handler grpc.aio returns for it, so a changed handler is wrapped again, never
served stale. docs/architecture.md ("One process") describes the whole server.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

import grpc
import grpc.aio
from opentelemetry import trace
from prometheus_client import Counter, Histogram

from turnstile_platform.authz.authorizer import Authorizer
from turnstile_platform.authz.methods import CLIENT_SOURCES
from turnstile_platform.authz.ownership import current_identity
from turnstile_platform.call_limits import CallKind, CallLimits, enter_flow
from turnstile_platform.decoding import Undecodable, checked, refuse, tolerant
from turnstile_platform.dependencies import DEPENDENCY_ERRORS
from turnstile_platform.errors import RichError, abort, dependency_error
from turnstile_platform.fair_share import FlowId, Seat, Seats
from turnstile_platform.flows import ANONYMOUS
from turnstile_platform.handlers import Behaviour, MethodName, behaviour_of, rebuilt, yields
from turnstile_platform.log_throttle import LogThrottle
from turnstile_platform.tracing import ServerSpan, ServerSpans, traced_service

log = logging.getLogger(__name__)

#: One traceback per (method, error type) a minute; the next line says how many more
#: (a caller that can make a handler fail must not write a traceback per call).
ERROR_LOG = LogThrottle(log)

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
DEPENDENCY_REFUSALS = Counter(
    "turnstile_grpc_server_dependency_refusals_total",
    "RPCs answered UNAVAILABLE because a dependency failed, by method, dependency "
    "and reason (DEPENDENCY_UNAVAILABLE, or REPLICA_OVERLOADED: shed by this "
    "replica's own overload, never a fail mode).",
    ["grpc_service", "grpc_method", "dependency", "reason"],
)

#: Methods whose wrapped handler is kept (registered methods are far fewer).
_KNOWN_LIMIT = 4096
_PLATFORM_SERVICES = ("grpc.health.", "grpc.reflection.")
Context = grpc.aio.ServicerContext[Any, Any]
Handler: TypeAlias = "grpc.RpcMethodHandler[Any, Any]"
# Generic in grpc-stubs only: the class itself cannot be subscripted.
if TYPE_CHECKING:
    _ServerInterceptor = grpc.aio.ServerInterceptor[Any, Any]
else:
    _ServerInterceptor = grpc.aio.ServerInterceptor


class PlatformInterceptor(_ServerInterceptor):
    """Serves every method through the steps in the module docstring.

    ``spans`` None traces nothing, ``limits`` None counts no slots, ``authorizer``
    None authorizes nothing (loopback plaintext). ``retry_after_s`` is the retry
    hint of a call refused because a dependency failed (the service's
    ``TURNSTILE_RETRY_AFTER_S``)."""

    def __init__(
        self,
        *,
        spans: ServerSpans | None,
        limits: CallLimits | None = None,
        authorizer: Authorizer | None = None,
        retry_after_s: float = 1.0,
    ) -> None:
        self._spans = spans
        self._limits = limits
        self._authorizer = authorizer
        self._retry_after_s = retry_after_s
        self._known: dict[str, tuple[Handler, Handler]] = {}

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[Handler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler:
        handler: Handler | None = await continuation(handler_call_details)
        if handler is None:
            return None  # type: ignore[return-value]  # grpc-stubs says never None; it can be
        path = handler_call_details.method
        known = self._known.get(path)
        if known is not None and known[0] is handler:
            return known[1]
        wrapped = self._wrap(MethodName.of(path), handler)
        if path in self._known or len(self._known) < _KNOWN_LIMIT:
            self._known[path] = (handler, wrapped)
        return wrapped

    def _wrap(self, name: MethodName, handler: Handler) -> Handler:
        served = _Method(
            name,
            bool(handler.request_streaming or handler.response_streaming),
            spans=self._spans,
            limits=self._limits,
            authorizer=self._authorizer,
            retry_after_s=self._retry_after_s,
        )
        behaviour = behaviour_of(handler)
        streaming_request = bool(handler.request_streaming)
        wrapper = _generator if yields(behaviour) else _coroutine
        return rebuilt(
            handler,
            wrapper(served, behaviour, streaming_request),
            tolerant(handler.request_deserializer),
        )


def _coroutine(method: _Method, behaviour: Behaviour, streaming_request: bool) -> Behaviour:
    if streaming_request:

        async def stream_in(request: Any, context: Context) -> Any:
            async with _Serving(method, context) as serving:
                return await behaviour(await serving.admitted(request, True), context)

        return stream_in

    # A unary request, the hot path: the steps of :class:`_Serving` written out in
    # one coroutine, so a call creates and awaits none for its entry, admission
    # and exit (about 1 µs a call, docs/performance.md).
    async def call(request: Any, context: Context) -> Any:
        serving = _Serving(method, context)
        serving.enter()
        try:
            if method.authorizer is not None or isinstance(request, Undecodable):
                request = await serving.admitted(request, False)
            elif not serving.take_seat_now():
                await serving.take_seat(ANONYMOUS)
            response = await behaviour(request, context)
        except BaseException as error:
            await serving.failed(error)
            raise
        serving.succeeded()
        return response

    return call


def _generator(method: _Method, behaviour: Behaviour, streaming_request: bool) -> Behaviour:
    async def stream(request: Any, context: Context) -> AsyncIterator[Any]:
        async with _Serving(method, context) as serving:
            admitted = await serving.admitted(request, streaming_request)
            async for response in behaviour(admitted, context):
                yield response

    return stream


class _Method:
    """What serving one method needs, worked out once: its names, whether it is
    traced, counted and authorized, and its metric children."""

    __slots__ = (
        "_handled",
        "attributes",
        "authorizer",
        "client_source",
        "counted",
        "kind",
        "limits",
        "name",
        "reflection",
        "retry_after_s",
        "seats",
        "seconds",
        "spans",
        "streaming",
    )

    def __init__(
        self,
        name: MethodName,
        streaming: bool,
        *,
        spans: ServerSpans | None,
        limits: CallLimits | None,
        authorizer: Authorizer | None,
        retry_after_s: float = 1.0,
    ) -> None:
        self.name = name
        self.retry_after_s = retry_after_s
        self.counted = not name.service.startswith(_PLATFORM_SERVICES)
        self.kind = CallKind.STREAM if streaming else CallKind.UNARY
        self.streaming = streaming
        self.limits = limits if self.counted else None
        # A self-admitted stream's handler takes its seat itself (CallLimits), for
        # the flow found here.
        self.seats: Seats | None = (
            limits.seats[self.kind]
            if limits is not None and self.counted and not limits.admits_itself(name.path)
            else None
        )
        self.client_source = CLIENT_SOURCES.get(name.path)
        self.spans = spans if spans is not None and traced_service(name.service) else None
        self.attributes = ServerSpans.attributes(name.service, name.method)
        self.authorizer = None if name.service.startswith("grpc.health.") else authorizer
        self.reflection = name.service.startswith("grpc.reflection.")
        self.seconds = RPC_SECONDS.labels(name.service, name.method) if self.counted else None
        self._handled: dict[object, Any] = {}

    def count(self, code: object, seconds: float) -> None:
        if self.seconds is None:
            return
        counter = self._handled.get(code)
        if counter is None:
            label = code.name if isinstance(code, grpc.StatusCode) else str(code)
            counter = self._handled[code] = RPCS.labels(self.name.service, self.name.method, label)
        counter.inc()
        self.seconds.observe(seconds)


class _Serving:
    """One call of a method, around its handler: span and clock on entry
    (:meth:`enter`); authorization, seat and decoding through :meth:`admitted`;
    on exit the seat freed, what was raised turned into the status, the RPC
    counted and the span ended (:meth:`succeeded`, :meth:`failed`). Streams use
    it as an async context manager; a unary call's wrapper calls the steps
    itself (:func:`_coroutine`)."""

    __slots__ = ("_context", "_method", "_seat", "_span", "_started")

    def __init__(self, method: _Method, context: Context) -> None:
        self._method = method
        self._context = context
        self._seat: Seat | None = None
        self._span: ServerSpan | None = None
        self._started = 0.0

    async def __aenter__(self) -> _Serving:
        self.enter()
        return self

    def enter(self) -> None:
        """The span started and made current; the clock started."""
        method = self._method
        if method.spans is not None:
            self._span = method.spans.start(self._context, method.name.path, method.attributes)
        self._started = time.perf_counter()

    def take_seat_now(self) -> bool:
        """The anonymous flow's seat taken if it may have one now (or the method
        takes none); False: :meth:`take_seat` must wait for it or refuse."""
        seats = self._method.seats
        if seats is None:
            return True
        self._seat = seats.try_take(ANONYMOUS)
        return self._seat is not None

    async def take_seat(self, flow: FlowId) -> None:
        """A seat for ``flow`` taken, waiting in its queue if need be, or
        ``RESOURCE_EXHAUSTED`` raised."""
        method = self._method
        if method.streaming and method.limits is not None:
            enter_flow(flow)  # for a self-admitted handler's own acquire
        if method.seats is not None:
            self._seat = await method.seats.take(flow, method.name.method)

    async def admitted(self, request: Any, streaming: bool) -> Any:
        """The request the handler gets, once the call is authorized and holds its
        seat (a refusal raises). A request stream is checked message by message as
        the handler reads it."""
        method, context = self._method, self._context
        authorizer = method.authorizer
        if authorizer is None:
            await self.take_seat(ANONYMOUS)
        else:
            path = method.name.path
            decision = await authorizer.check_call(context, path, method.reflection)
            if decision is not None and method.limits is not None:
                source = None if streaming or isinstance(request, Undecodable) else request
                flow = method.limits.classifier.flow(
                    current_identity(),
                    decision,
                    method.client_source if source is not None else None,
                    source,
                )
                await self.take_seat(flow)
            await authorizer.check_client(context, path, decision, None if streaming else request)
        if streaming:
            return checked(request, context, method.name)
        if isinstance(request, Undecodable):
            await refuse(context, method.name, request)
        return request

    async def __aexit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is None:
            self.succeeded()
        else:
            await self.failed(error)

    def succeeded(self) -> None:
        """The handler returned: the seat freed, the call counted with the code it
        set (OK by default), the span ended."""
        self._free_seat()
        self._finish(_code_set(self._context))

    async def failed(self, error: BaseException) -> None:
        """The handler raised ``error``: the seat freed, the status sent for it (an
        exception raises the ``AbortError`` of that status instead; anything else,
        a cancellation or a stream closed early, goes on as it is: None returned),
        the call counted and the span ended."""
        self._free_seat()
        code: object = grpc.StatusCode.OK
        if isinstance(error, DEPENDENCY_ERRORS):
            error = self._refusal(error)
        try:
            code = _status_of(error, self._context)
            if isinstance(error, Exception):
                await _answer(self._context, self._method.name, error)
        finally:
            self._finish(code)

    def _refusal(self, error: BaseException) -> RichError:
        """The one answer to a failing dependency, counted by its reason."""
        assert isinstance(error, DEPENDENCY_ERRORS)
        method = self._method
        refusal = dependency_error(error, method.retry_after_s)
        refusal.__cause__ = error
        DEPENDENCY_REFUSALS.labels(
            method.name.service, method.name.method, error.dependency, refusal.reason
        ).inc()
        return refusal

    def _free_seat(self) -> None:
        seat = self._seat
        if seat is not None:
            # Freed before the status goes out: a caller that saw this call end
            # finds its seat free.
            self._seat = None
            self._method.seats.release(seat)  # type: ignore[union-attr]  # set with the seat

    def _finish(self, code: object) -> None:
        self._method.count(code, time.perf_counter() - self._started)
        if self._span is not None:
            ServerSpans.end(self._span, code, self._context)


def _code_set(context: Context) -> object:
    """The code the handler set or aborted with (grpc.aio says None for none: OK)."""
    code: object = context.code()
    return grpc.StatusCode.OK if code is None else code


def _status_of(error: BaseException, context: Context) -> object:
    """The status code the call ends with, given what its handler raised."""
    if isinstance(error, RichError):
        return error.code
    if isinstance(error, asyncio.CancelledError):
        return grpc.StatusCode.CANCELLED
    if isinstance(error, NotImplementedError):
        return grpc.StatusCode.UNIMPLEMENTED
    if isinstance(error, (grpc.aio.AbortError, grpc.aio.UsageError)) or not isinstance(
        error, Exception
    ):
        return _code_set(context)
    return grpc.StatusCode.INTERNAL


async def _answer(context: Context, name: MethodName, error: Exception) -> None:
    """Send the status for what the handler raised (so raise ``AbortError``), unless
    the handler aborted already (then the error goes on as it is)."""
    if isinstance(error, (grpc.aio.AbortError, grpc.aio.UsageError)):
        return
    if isinstance(error, RichError):
        await abort(context, error)
    if isinstance(error, NotImplementedError):
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"{name.method} is not implemented")
    rpc = f"{name.service}/{name.method}"
    kind = type(error).__qualname__
    ERROR_LOG.log(
        logging.ERROR,
        (rpc, kind),
        "unhandled error",
        {"rpc": rpc, "error_type": kind},
        exc_info=error,
    )
    trace.get_current_span().record_exception(error)
    await context.abort(grpc.StatusCode.INTERNAL, "internal error")
