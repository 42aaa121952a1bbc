"""The authorization check: identity, method and client checked before the handler.

For every call but health (open: kubelet probes carry no certificate) and reflection
(open to any identity): the caller's SPIFFE ID from the verified peer certificate
(none: UNAUTHENTICATED); the policy's decision for (identity, method) (not allowed:
PERMISSION_DENIED); and, for a method that acts for a client
(:data:`~turnstile_platform.authz.methods.CLIENT_SOURCES`), every client the call acts
for must be allowed. A call let through carries its
:class:`~turnstile_platform.authz.ownership.CallerScope`, so the handler checks the
record it reads against the same decision (SPEC O1).

Refusals carry ``ErrorInfo`` (metadata ``identity`` and ``method``), are counted per
identity and logged once a minute per identity, method and reason
(:mod:`turnstile_platform.log_throttle`, SPEC O6); the handler never runs. The
platform interceptor runs :meth:`Authorizer.authorize` once the call holds its slot;
in loopback plaintext there is no authorizer at all.
"""

from __future__ import annotations

import logging
from typing import Any, Protocol

import grpc
from prometheus_client import Counter

from turnstile_contracts import common_pb2
from turnstile_platform.authz.methods import CLIENT_SOURCES, OwnerLookup, refusal
from turnstile_platform.authz.ownership import (
    PERMISSION_DENIED_REASON,
    CallerScope,
    enter_identity,
    enter_scope,
)
from turnstile_platform.authz.policy import AuthzDecision, AuthzPolicy
from turnstile_platform.decoding import Undecodable
from turnstile_platform.errors import RichError, abort
from turnstile_platform.identity import peer_identity
from turnstile_platform.log_throttle import LogThrottle

log = logging.getLogger(__name__)

DECISIONS = Counter(
    "turnstile_authz_decisions_total",
    "Authorization decisions, by identity (as named in the policy, the rest as 'other') "
    "and outcome (allowed, denied, unauthenticated).",
    ["identity", "outcome"],
)

#: One "call refused" line per (identity, method, reason) a minute; the rest counted
#: on the next line (SPEC O6). Every refusal is still counted in :data:`DECISIONS`.
REFUSAL_LOG = LogThrottle(log)

_UNAUTHENTICATED = common_pb2.ErrorReason.Name(
    common_pb2.ERROR_REASON_UNAUTHENTICATED
).removeprefix("ERROR_REASON_")
_PERMISSION_DENIED = PERMISSION_DENIED_REASON


class PolicySource(Protocol):
    @property
    def policy(self) -> AuthzPolicy: ...


class Authorizer:
    """Checks every call against the live policy before its handler runs."""

    def __init__(self, source: PolicySource, owner: OwnerLookup | None = None) -> None:
        self.source = source
        self.owner = owner
        self._counters: dict[tuple[str, str], Any] = {}

    def set_owner_lookup(self, owner: OwnerLookup) -> None:
        """How this service resolves a sandbox id to its recorded client."""
        self.owner = owner

    async def authorize(self, context: Any, method: str, reflection: bool, request: Any) -> None:
        """Refuse the call (abort, so this raises) unless the policy allows it.

        ``method`` is the full path (``/pkg.Service/Method``; health is never
        checked: the caller leaves it out); ``reflection`` asks for an identity
        only. ``request`` is the unary request, or None for a request stream
        (such a method acts for no client)."""
        decision = await self.check_call(context, method, reflection)
        await self.check_client(context, method, decision, request)

    def _count(self, label: str, outcome: str) -> None:
        counter = self._counters.get((label, outcome))
        if counter is None:
            counter = self._counters[(label, outcome)] = DECISIONS.labels(label, outcome)
        counter.inc()

    async def _refuse(self, context: Any, identity: str, method: str, label: str, why: str) -> None:
        """Abort the call (always raises): UNAUTHENTICATED without an identity,
        PERMISSION_DENIED otherwise; counted and logged."""
        if identity:
            code, reason, outcome = grpc.StatusCode.PERMISSION_DENIED, _PERMISSION_DENIED, "denied"
        else:
            code, reason, outcome = (
                grpc.StatusCode.UNAUTHENTICATED,
                _UNAUTHENTICATED,
                "unauthenticated",
            )
        self._count(label, outcome)
        REFUSAL_LOG.warning(
            (identity, method, reason),
            "call refused",
            {"identity": identity or "-", "rpc": method, "reason": reason, "why": why},
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

    def _scope(self, identity: str, method: str, decision: AuthzDecision) -> CallerScope:
        """The scope a handler checks its records against; a refusal it makes is
        counted and logged like this authorizer's own."""

        def report(why: str) -> None:
            self._count(decision.label, "denied")
            # Throttled with the authorizer's own refusals: a tenant can make a
            # handler refuse at its call rate (an id of its namespace recorded to
            # another client), SPEC O6.
            REFUSAL_LOG.warning(
                (identity, method, _PERMISSION_DENIED),
                "call refused",
                {"identity": identity, "rpc": method, "reason": _PERMISSION_DENIED, "why": why},
            )

        return CallerScope(identity, method, decision, report)

    async def check_call(self, context: Any, method: str, reflection: bool) -> AuthzDecision | None:
        """The decision if the caller may call ``method`` at all (aborts otherwise)."""
        identity = peer_identity(context)
        if identity is None:
            await self._refuse(
                context, "", method, "other", "no SPIFFE identity in the peer certificate"
            )
            return None  # unreachable: abort raises
        if reflection:
            return None
        enter_identity(identity)
        decision = self.source.policy.decide(identity, method)
        if not decision.allowed:
            why = "identity may not call this method"
            await self._refuse(context, identity, method, decision.label, why)
        return decision

    async def check_client(
        self, context: Any, method: str, decision: AuthzDecision | None, request: Any
    ) -> None:
        if decision is None or decision.any_client:
            if decision is not None:
                enter_scope(None)
                self._count(decision.label, "allowed")
            return
        source = CLIENT_SOURCES.get(method)
        if source is not None and not isinstance(request, Undecodable):
            # (An undecodable request names no client; the platform interceptor
            # answers it INVALID_ARGUMENT next, before any handler runs.)
            identity = peer_identity(context) or ""
            why = await refusal(source, request, decision, self.owner)
            if why is not None:
                await self._refuse(context, identity, method, decision.label, why)
            enter_scope(self._scope(identity, method, decision))
        self._count(decision.label, "allowed")
