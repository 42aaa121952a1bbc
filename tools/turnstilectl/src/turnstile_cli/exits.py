"""Exit codes of ``turnstilectl``: scripts tell a refusal from a retry from a failure.

=====  ==========  ==============================================================
code   name        when
=====  ==========  ==============================================================
0      OK          the command did what it was asked
1      ERROR       Turnstile or the CLI failed (NOT_FOUND, INTERNAL, a bad config)
2      USAGE       the command line or the request was invalid (INVALID_ARGUMENT)
3      REFUSED     a limit said no: cap, rate, concurrency, node slots, tier full
4      RETRYABLE   try again soon: pending, busy, a service or dependency unavailable
5      TRANSPORT   the connection's security failed: a certificate problem (wrong CA,
                   a key not the certificate's, a wrong server identity) or plaintext
                   against TLS; retrying will not help (:mod:`turnstile_cli.transport`)
=====  ==========  ==============================================================

A refusal may carry a retry hint too (a rate refusal says when tokens return);
it is still REFUSED, because a policy decided, not a transient failure.
"""

from __future__ import annotations

import enum
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # imported by the parser's path: grpc only when a call failed
    from turnstile_client import TurnstileError


class Exit(enum.IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    REFUSED = 3
    RETRYABLE = 4
    TRANSPORT = 5


#: ErrorInfo reasons that are a policy's refusal, whatever the status code.
REFUSAL_REASONS = frozenset(
    {
        "CAP_EXCEEDED",
        "RATE_LIMITED",
        "CONCURRENCY_LIMITED",
        "NODE_SLOTS_EXHAUSTED",
        "TIER_EXHAUSTED",
    }
)

#: ErrorInfo reasons that say "the same request may succeed shortly".
RETRYABLE_REASONS = frozenset(
    {
        "SANDBOX_PENDING",
        "SANDBOX_BUSY",
        "DEPENDENCY_UNAVAILABLE",
        "POLICY_BACKEND_UNAVAILABLE",
        "REPLICA_OVERLOADED",
    }
)

_RETRYABLE_CODES = frozenset({"UNAVAILABLE", "DEADLINE_EXCEEDED", "ABORTED"})


class UsageError(Exception):
    """A command line that cannot be run as given (exit 2, message on stderr)."""


def for_error(error: TurnstileError) -> Exit:
    """The exit code of a failed call."""
    code = error.code.name
    if error.reason in REFUSAL_REASONS:
        return Exit.REFUSED
    if error.reason in RETRYABLE_REASONS or code in _RETRYABLE_CODES:
        return Exit.RETRYABLE
    if code == "RESOURCE_EXHAUSTED":
        return Exit.REFUSED
    if code == "INVALID_ARGUMENT":
        return Exit.USAGE
    return Exit.ERROR


def known_failure(error: BaseException) -> tuple[str, Exit] | None:
    """The message and exit code of a failure a command may meet outside an RPC:
    an invalid ``TURNSTILE_*`` setting or key-set change (2), Redis unreachable (4).
    Looked up in ``sys.modules``: an exception of a module never imported cannot
    have been raised, and importing it here would cost every command its time."""
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(error, pydantic.ValidationError):
        return f"invalid TURNSTILE_* setting: {error}", Exit.USAGE
    keyset = sys.modules.get("turnstile_clientkeys.keyset")
    if keyset is not None and isinstance(error, keyset.KeySetError):
        return str(error), Exit.USAGE
    tls = sys.modules.get("turnstile_platform.tls")
    if tls is not None and isinstance(error, tls.TransportSecurityError):
        return f"{error} (see the README: getting a client certificate)", Exit.USAGE
    redis = sys.modules.get("redis.exceptions")
    if redis is not None and isinstance(error, redis.RedisError):
        return f"Redis: {error}", Exit.RETRYABLE
    return None
