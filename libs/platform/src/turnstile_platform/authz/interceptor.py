"""The authorization interceptor: identity, method and client checked before the handler.

For every call but health (always open: kubelet probes carry no certificate)
and reflection (open to any caller with an identity):

1. the caller's SPIFFE ID from the verified peer certificate
   (:func:`turnstile_platform.identity.peer_identity`); none → UNAUTHENTICATED;
2. the policy's decision for (identity, method); not allowed → PERMISSION_DENIED;
3. for a method that acts for a client (:data:`~turnstile_platform.authz.methods.CLIENT_SOURCES`),
   unless the identity may act for any client: the client the call acts for, which
   must be one the decision allows → PERMISSION_DENIED otherwise.

Refusals carry ``ErrorInfo`` (reason ``UNAUTHENTICATED`` / ``PERMISSION_DENIED``,
metadata ``identity`` and ``method``), are counted per identity label and logged
once each. The handler never runs for a refused call, so nothing changes.

With ``policy_source=None`` (explicit loopback plaintext) there are no
identities and the interceptor is not installed at all.
"""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc
import grpc.aio
from prometheus_client import Counter

from turnstile_contracts import common_pb2
from turnstile_platform.authz.methods import CLIENT_SOURCES, OwnerLookup, client_of
from turnstile_platform.authz.policy import Decision, Policy
from turnstile_platform.decoding import Undecodable
from turnstile_platform.errors import RichError, abort
from turnstile_platform.identity import peer_identity

log = logging.getLogger(__name__)

DECISIONS = Counter(
    "turnstile_authz_decisions_total",
    "Authorization decisions, by identity (as named in the policy, the rest as 'other') "
    "and outcome (allowed, denied, unauthenticated).",
    ["identity", "outcome"],
)

_UNAUTHENTICATED = common_pb2.ErrorReason.Name(
    common_pb2.ERROR_REASON_UNAUTHENTICATED
).removeprefix("ERROR_REASON_")
_PERMISSION_DENIED = common_pb2.ErrorReason.Name(
    common_pb2.ERROR_REASON_PERMISSION_DENIED
).removeprefix("ERROR_REASON_")

Handler = Callable[..., Any]


class PolicySource(Protocol):
    @property
    def policy(self) -> Policy: ...


class AuthorizationInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Checks every call against the live policy before its handler runs."""

    def __init__(self, source: PolicySource, owner: OwnerLookup | None = None) -> None:
        self.source = source
        self.owner = owner
        self._counters: dict[tuple[str, str], Any] = {}

    def set_owner_lookup(self, owner: OwnerLookup) -> None:
        """How this service resolves a sandbox id to its recorded client."""
        self.owner = owner

    def _count(self, label: str, outcome: str) -> None:
        counter = self._counters.get((label, outcome))
        if counter is None:
            counter = self._counters[(label, outcome)] = DECISIONS.labels(label, outcome)
        counter.inc()

    async def intercept_service(
        self,
        continuation: Callable[
            [grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]
        ],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler: grpc.RpcMethodHandler[Any, Any] | None = await continuation(handler_call_details)
        if handler is None:
            return None  # type: ignore[return-value]
        method = handler_call_details.method
        if method.startswith("/grpc.health."):
            return handler
        reflection = method.startswith("/grpc.reflection.")
        if handler.unary_unary is not None:
            return grpc.unary_unary_rpc_method_handler(
                self._wrap_unary(handler.unary_unary, method, reflection),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_stream is not None:
            return grpc.stream_stream_rpc_method_handler(
                self._wrap_stream(handler.stream_stream, method, reflection),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.unary_stream is not None:
            return grpc.unary_stream_rpc_method_handler(
                self._wrap_unary_stream(handler.unary_stream, method, reflection),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        if handler.stream_unary is not None:
            return grpc.stream_unary_rpc_method_handler(
                self._wrap_stream_unary(handler.stream_unary, method, reflection),
                request_deserializer=handler.request_deserializer,
                response_serializer=handler.response_serializer,
            )
        return handler

    async def _refuse(
        self,
        context: Any,
        code: grpc.StatusCode,
        reason: str,
        identity: str,
        method: str,
        label: str,
        why: str,
    ) -> None:
        outcome = "unauthenticated" if reason == _UNAUTHENTICATED else "denied"
        self._count(label, outcome)
        log.warning(
            "call refused",
            extra={"identity": identity or "-", "rpc": method, "reason": reason, "why": why},
        )
        await abort(
            context,
            RichError(
                code,
                f"{why}: {method}",
                reason,
                metadata={"identity": identity, "method": method.lstrip("/")},
            ),
        )

    async def _check_call(self, context: Any, method: str, reflection: bool) -> Decision | None:
        """The decision if the caller may call ``method`` at all (aborts otherwise)."""
        identity = peer_identity(context)
        if identity is None:
            await self._refuse(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                _UNAUTHENTICATED,
                "",
                method,
                "other",
                "no SPIFFE identity in the peer certificate",
            )
            return None  # unreachable: abort raises
        if reflection:
            return None
        decision = self.source.policy.decide(identity, method)
        if not decision.allowed:
            await self._refuse(
                context,
                grpc.StatusCode.PERMISSION_DENIED,
                _PERMISSION_DENIED,
                identity,
                method,
                decision.label,
                "identity may not call this method",
            )
        return decision

    async def _check_client(
        self, context: Any, method: str, decision: Decision | None, request: Any
    ) -> None:
        if decision is None or decision.any_client:
            if decision is not None:
                self._count(decision.label, "allowed")
            return
        source = CLIENT_SOURCES.get(method)
        if source is not None and not isinstance(request, Undecodable):
            # (An undecodable request names no client; the decoding wrapper inside
            # answers it INVALID_ARGUMENT before any handler runs.)
            client = await client_of(source, request, self.owner)
            if not decision.allows_client(client):
                identity = peer_identity(context) or ""
                await self._refuse(
                    context,
                    grpc.StatusCode.PERMISSION_DENIED,
                    _PERMISSION_DENIED,
                    identity,
                    method,
                    decision.label,
                    f"identity may not act for client {client or '(none)'!r}",
                )
        self._count(decision.label, "allowed")

    def _wrap_unary(self, behaviour: Handler, method: str, reflection: bool) -> Handler:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            decision = await self._check_call(context, method, reflection)
            await self._check_client(context, method, decision, request)
            return await behaviour(request, context)

        return wrapper

    def _wrap_unary_stream(self, behaviour: Handler, method: str, reflection: bool) -> Handler:
        async def wrapper(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            decision = await self._check_call(context, method, reflection)
            await self._check_client(context, method, decision, request)
            async for response in behaviour(request, context):
                yield response

        return wrapper

    def _wrap_stream(self, behaviour: Handler, method: str, reflection: bool) -> Handler:
        if inspect.isasyncgenfunction(behaviour):

            async def generator(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                decision = await self._check_call(context, method, reflection)
                await self._check_client(context, method, decision, None)
                async for response in behaviour(requests, context):
                    yield response

            return generator

        async def coroutine(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            decision = await self._check_call(context, method, reflection)
            await self._check_client(context, method, decision, None)
            return await behaviour(requests, context)

        return coroutine

    def _wrap_stream_unary(self, behaviour: Handler, method: str, reflection: bool) -> Handler:
        async def wrapper(requests: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            decision = await self._check_call(context, method, reflection)
            await self._check_client(context, method, decision, None)
            return await behaviour(requests, context)

        return wrapper
