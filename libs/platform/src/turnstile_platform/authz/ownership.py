"""Sandbox ownership for scoped callers (SPEC O1): id namespaces, and the caller's scope
handed to the handler so it can check the record it reads.

A sandbox's owner is the client it is recorded to. A sandbox id ``<client>--<name>``
lies in ``<client>``'s **namespace**: an identity scoped to ``self`` or a list may
create only ids in the namespaces of clients it may act for, so one tenant cannot
take an id first and deny it to another (squatting). The namespace is the part
before the *first* ``--``, so every id has at most one namespace and no client can
reach into another's (``acme--corp--x`` is ``acme``'s, never ``acme--corp``'s; a
client id containing ``--`` owns no namespace). Identities scoped ``any`` are not
bound by namespaces.

The authorizer refuses what it can decide before the handler runs. For ``Activate``
of an id in the caller's own namespace it spares the owner lookup and leaves the
record to the handler, which reads it anyway (under the sandbox's claim) and checks
it against :func:`current_scope` — the same check, closing the gap between the
authorizer's read and the activation's. Every "not yours" is answered like "does
not exist": :func:`denied` with :func:`sandbox_why`, which names only the id the
caller sent, never the owner.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

import grpc

from turnstile_contracts import common_pb2
from turnstile_platform.authz.policy import AuthzDecision
from turnstile_platform.errors import RichError

#: Between a client id and the rest of a sandbox id in that client's namespace.
NAMESPACE_SEPARATOR = "--"

PERMISSION_DENIED_REASON = common_pb2.ErrorReason.Name(
    common_pb2.ERROR_REASON_PERMISSION_DENIED
).removeprefix("ERROR_REASON_")


def namespace_of(sandbox_id: str) -> str | None:
    """The client whose namespace ``sandbox_id`` is in (None: in no namespace)."""
    client, separator, name = sandbox_id.partition(NAMESPACE_SEPARATOR)
    return client if separator and client and name else None


#: How much of a caller-sent id a refusal echoes. Authorization runs before
#: validation, so the id may be anything up to the message size limit; every valid
#: sandbox or client id is shorter (63 characters).
ECHO_CHARS = 64


def _echo(value: str) -> str:
    """``value`` as a refusal echoes it: quoted, and cut after :data:`ECHO_CHARS`
    (a megabyte-long id would otherwise be a megabyte-long status and log line)."""
    if len(value) <= ECHO_CHARS:
        return repr(value)
    return f"{value[:ECHO_CHARS]!r}... ({len(value)} characters)"


def client_why(client: str | None) -> str:
    """Why a call naming ``client`` is refused (the caller named it: it may be echoed)."""
    return f"identity may not act for client {_echo(client) if client else repr('(none)')}"


def sandbox_why(sandbox_id: str) -> str:
    """Why a call on ``sandbox_id`` is refused: the same words whether the sandbox is
    another client's, in another's namespace, or does not exist."""
    return f"identity may not act for sandbox {_echo(sandbox_id)}"


def denied(identity: str, method: str, why: str) -> RichError:
    """The authorization layer's PERMISSION_DENIED (one shape, wherever it is raised)."""
    return RichError(
        grpc.StatusCode.PERMISSION_DENIED,
        f"{why}: {method}",
        PERMISSION_DENIED_REASON,
        metadata={"identity": identity, "method": method.lstrip("/")},
    )


@dataclass(frozen=True)
class CallerScope:
    """What a scoped caller (not ``any``) may act for, as the handler sees it."""

    identity: str
    method: str
    decision: AuthzDecision
    #: Counts and logs a refusal the handler makes (the authorizer's bookkeeping).
    report: Callable[[str], None]

    def allows(self, client_id: str | None) -> bool:
        return self.decision.allows_client(client_id)

    def owns(self, sandbox_id: str, recorded: str | None, *, recorded_only: bool = False) -> bool:
        """Whether the caller may act on ``sandbox_id`` recorded to ``recorded``: the
        recorded client, or with none recorded the id's namespace client — unless
        ``recorded_only`` (``inherit``, reads, Deactivate: they act for the recorded
        client alone, so they need one)."""
        if recorded is not None:
            return self.allows(recorded)
        return not recorded_only and self.allows(namespace_of(sandbox_id))

    def refusal(self, sandbox_id: str) -> RichError:
        """The refusal of a sandbox the caller does not own (counted and logged)."""
        why = sandbox_why(sandbox_id)
        self.report(why)
        return denied(self.identity, self.method, why)


_SCOPE: ContextVar[CallerScope | None] = ContextVar("turnstile_caller_scope", default=None)


def current_scope() -> CallerScope | None:
    """The scope of the call being served, set for the methods that act for a client
    (``methods.CLIENT_SOURCES``); None when the caller may act for any client, or the
    server runs no authorization (loopback plaintext). A handler of another method
    must not read None here as "any client": it is not set there."""
    return _SCOPE.get()


_IDENTITY: ContextVar[str] = ContextVar("turnstile_caller_identity", default="")


def current_identity() -> str:
    """The SPIFFE ID of the call being served, as the authorizer read it from the
    verified peer certificate; empty on a server without authorization (loopback
    plaintext). For records of who called (the decision log, SPEC Q3), never for
    a decision: the authorizer has decided already."""
    return _IDENTITY.get()


def enter_identity(identity: str) -> None:
    """Set the caller's identity for the rest of this call (the authorizer)."""
    _IDENTITY.set(identity)


def enter_scope(scope: CallerScope | None) -> None:
    """Set the scope for the rest of this call (each gRPC call runs in its own task,
    whose context no other call shares)."""
    _SCOPE.set(scope)
