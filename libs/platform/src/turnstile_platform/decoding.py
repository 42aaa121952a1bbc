"""Undecodable request bytes answered with INVALID_ARGUMENT, in one place, for every RPC.

grpc.aio deserializes a request with the method handler's ``request_deserializer``
before (unary requests) or while (``async for`` over a request stream) the handler
runs. When that raises, grpc.aio answers ``UNKNOWN`` with the exception's class
name in the message and logs a full traceback per call; the ``Attach`` stream's
handler sees the exception mid-iteration and answers ``INTERNAL``. A caller sent
bad bytes: that is ``INVALID_ARGUMENT``, and the log needs one short warning, not
a traceback an attacker can multiply.

The platform interceptor (:mod:`turnstile_platform.interceptors`, on every
service, health and reflection included) gives each handler the
:func:`tolerant` form of its deserializer, which returns an :class:`Undecodable`
marker instead of raising, and answers the marker with ``INVALID_ARGUMENT``
naming the field ``request`` (:func:`refuse`, :func:`checked` for request
streams) once the caller is authorized and before any servicer code sees it.
The warning is throttled per method (:data:`WARN_INTERVAL_S`,
:mod:`turnstile_platform.log_throttle`) and counts the calls it did not log.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import grpc.aio
from prometheus_client import Counter

from turnstile_platform.errors import abort, bad_field
from turnstile_platform.handlers import MethodName
from turnstile_platform.log_throttle import LogThrottle

log = logging.getLogger(__name__)

UNDECODABLE = Counter(
    "turnstile_grpc_server_undecodable_requests_total",
    "Requests whose bytes did not decode as the method's request message, by method.",
    ["grpc_service", "grpc_method"],
)

#: At most one warning per method in this many seconds; the rest are counted.
WARN_INTERVAL_S = 60.0
_REASON_CHARS = 120


@dataclass(frozen=True)
class Undecodable:
    """What the wrapped deserializer returns for bytes that do not decode."""

    message_type: str
    size: int
    reason: str


#: One warning per method per interval (:mod:`turnstile_platform.log_throttle`).
warnings = LogThrottle(log, interval_s=WARN_INTERVAL_S)


def tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    """``deserializer``, returning an :class:`Undecodable` marker instead of raising."""
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


async def refuse(
    context: grpc.aio.ServicerContext[Any, Any], name: MethodName, bad: Undecodable
) -> None:
    """Answer INVALID_ARGUMENT naming ``request`` (always raises), counted and warned."""
    UNDECODABLE.labels(name.service, name.method).inc()
    warnings.warning(
        name.path,
        "undecodable request answered INVALID_ARGUMENT",
        {
            "rpc": name.path,
            "message_type": bad.message_type,
            "bytes": bad.size,
            "reason": bad.reason,
        },
    )
    await abort(
        context,
        bad_field("request", f"the request bytes do not decode as {bad.message_type}"),
    )


async def checked(
    requests: AsyncIterator[Any], context: grpc.aio.ServicerContext[Any, Any], name: MethodName
) -> AsyncIterator[Any]:
    """The request stream, aborting the call at the first undecodable message.

    The abort sends the status at once, so a handler that catches broadly cannot
    turn it into another code.
    """
    async for request in requests:
        if isinstance(request, Undecodable):
            await refuse(context, name, request)
        yield request
