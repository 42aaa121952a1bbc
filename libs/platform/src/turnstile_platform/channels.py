"""gRPC channels to other Turnstile services: deadlines, retries, tracing.

Retries live in the channel's service config (gRPC's own mechanism) rather than
in hand-written loops: only the methods the caller declares idempotent are
retried, on UNAVAILABLE, with exponential backoff, each attempt inside the call's
deadline. Every unary call without a deadline of its own gets the channel's
default one from :class:`DefaultDeadline`. (The service config's ``timeout``
field would be the natural place, but on grpcio 1.85 a configured timeout under
about two seconds fails every call at once with DEADLINE_EXCEEDED, per-call
deadlines included, and longer ones sometimes end calls tens of milliseconds in
on a busy process — grpc/grpc#34547, #40633. A deadline set on the call is exact;
``libs/platform/tests/test_channels.py`` pins the behaviour we rely on.) Client spans
propagate the trace context so one trace crosses service boundaries (SPEC X4); a
caller that gives up cancels its call on the server (:class:`CancelWithCaller`).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, cast

import grpc
import grpc.aio
from opentelemetry import trace

from turnstile_platform import tls, tracing

# Generic in grpc-stubs only: the class itself cannot be subscripted.
if TYPE_CHECKING:
    _UnaryUnaryClientInterceptor = grpc.aio.UnaryUnaryClientInterceptor[Any, Any]
else:
    _UnaryUnaryClientInterceptor = grpc.aio.UnaryUnaryClientInterceptor


class DefaultDeadline(_UnaryUnaryClientInterceptor):
    """Gives every unary call without a deadline of its own a default one."""

    def __init__(self, timeout_s: float) -> None:
        self.timeout_s = timeout_s

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        if client_call_details.timeout is None:
            client_call_details = grpc.aio.ClientCallDetails(
                method=client_call_details.method,
                timeout=self.timeout_s,
                metadata=client_call_details.metadata,
                credentials=client_call_details.credentials,
                wait_for_ready=client_call_details.wait_for_ready,
            )
        return await continuation(client_call_details, request)


class CancelWithCaller(_UnaryUnaryClientInterceptor):
    """Waits for each unary call's end itself, so a caller that gives up cancels the
    call on the server: the client-span interceptor awaits the call's status, and a
    cancellation of that wait alone left the call running until its deadline
    (opentelemetry-python-contrib#3271). Innermost: it holds the call itself."""

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Any],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        call = await continuation(client_call_details, request)
        # Awaiting the call cancels it when this wait is cancelled (grpc.aio's own
        # await does); its error is the caller's to read, from the call.
        with contextlib.suppress(grpc.aio.AioRpcError):
            await call
        return call


def service_config(
    service: str,
    *,
    idempotent_methods: Iterable[str] = (),
    max_attempts: int = 3,
) -> str:
    """The JSON service config: retries for idempotent methods, on UNAVAILABLE."""
    idempotent = sorted(set(idempotent_methods))
    configs: list[dict[str, object]] = []
    if idempotent:
        configs.append(
            {
                "name": [{"service": service, "method": m} for m in idempotent],
                "retryPolicy": {
                    "maxAttempts": max_attempts,
                    "initialBackoff": "0.05s",
                    "maxBackoff": "0.5s",
                    "backoffMultiplier": 2,
                    "retryableStatusCodes": ["UNAVAILABLE"],
                },
            }
        )
    return json.dumps({"methodConfig": configs})


def create_channel(
    target: str,
    service: str,
    *,
    timeout_s: float,
    idempotent_methods: Iterable[str] = (),
    tracer_provider: trace.TracerProvider | None = None,
    max_message_bytes: int = 4 * 1024 * 1024,
    credentials: grpc.ChannelCredentials | None = None,
    server_id: str | None = None,
    client_spans: bool = True,
) -> grpc.aio.Channel:
    """A grpc.aio channel to ``target`` for calls to ``service``: mTLS with
    ``credentials`` (from :mod:`turnstile_platform.tls`) to a server that must hold
    the SPIFFE ID ``server_id`` (SPEC O5; None: the target's host name is checked),
    plaintext without credentials.

    ``service`` is the full service name (``turnstile.admission.v1.AdmissionService``).
    ``client_spans=False`` propagates the trace context without client spans
    (:func:`turnstile_platform.tracing.client_interceptors`).
    """
    provider = tracer_provider or trace.get_tracer_provider()
    options: list[tuple[str, object]] = [
        (
            "grpc.service_config",
            service_config(service, idempotent_methods=idempotent_methods),
        ),
        ("grpc.enable_retries", 1),
        ("grpc.max_receive_message_length", max_message_bytes),
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.keepalive_time_ms", 30_000),
    ]
    interceptors: list[grpc.aio.ClientInterceptor] = [
        *tracing.client_interceptors(provider, spans=client_spans),
        cast(grpc.aio.ClientInterceptor, DefaultDeadline(timeout_s)),
        cast(grpc.aio.ClientInterceptor, CancelWithCaller()),
    ]
    if credentials is not None:
        options += tls.server_check_options(server_id)
        return grpc.aio.secure_channel(
            target, credentials, options=options, interceptors=interceptors
        )
    return grpc.aio.insecure_channel(target, options=options, interceptors=interceptors)
