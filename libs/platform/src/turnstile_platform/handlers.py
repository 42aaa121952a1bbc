"""The four kinds of gRPC method handler, told apart and rebuilt in one place.

A method handler carries its behaviour in one of four fields (``unary_unary``,
``unary_stream``, ``stream_unary``, ``stream_stream``) and says which through
``request_streaming`` / ``response_streaming``. Whoever wraps a behaviour (the
platform interceptor, :mod:`turnstile_platform.interceptors`) needs the behaviour
out and a handler of the same kind back: :func:`behaviour_of` and
:func:`rebuilt` do that for every kind, so no caller spells the four cases out.

A behaviour of a response-streaming method is either an async generator
function (it yields responses) or a coroutine function (it writes through the
servicer context); grpc.aio tells them apart with :func:`inspect.isasyncgenfunction`,
so a wrapper must keep the kind it wraps (:func:`yields`).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

Behaviour = Callable[..., Any]
Deserializer = Callable[[bytes], Any] | None

_FACTORIES: dict[tuple[bool, bool], Callable[..., grpc.RpcMethodHandler[Any, Any]]] = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


@dataclass(frozen=True, slots=True)
class MethodName:
    """A method's full path (``/pkg.Service/Method``, as gRPC gives it) and its parts."""

    path: str
    service: str
    method: str

    @classmethod
    def of(cls, path: str) -> MethodName:
        service, _, method = path.lstrip("/").rpartition("/")
        return cls(path, service, method)


def behaviour_of(handler: grpc.RpcMethodHandler[Any, Any]) -> Behaviour:
    """The function ``handler`` runs, whichever of the four kinds it is."""
    if handler.request_streaming:
        found = handler.stream_stream if handler.response_streaming else handler.stream_unary
    else:
        found = handler.unary_stream if handler.response_streaming else handler.unary_unary
    if found is None:
        raise ValueError(f"method handler {handler!r} has no behaviour for its kind")
    return found


def yields(behaviour: Behaviour) -> bool:
    """Whether ``behaviour`` is an async generator function (its wrapper must be one)."""
    return inspect.isasyncgenfunction(behaviour)


def rebuilt(
    handler: grpc.RpcMethodHandler[Any, Any],
    behaviour: Behaviour,
    request_deserializer: Deserializer,
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of ``handler``'s kind running ``behaviour``, with its response
    serializer and the given request deserializer."""
    factory = _FACTORIES[(bool(handler.request_streaming), bool(handler.response_streaming))]
    return factory(
        behaviour,
        request_deserializer=request_deserializer,
        response_serializer=handler.response_serializer,
    )
