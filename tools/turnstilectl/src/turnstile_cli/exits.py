"""Exit codes of ``turnstilectl``: scripts tell a refusal from a retry from a failure.

=====  ==========  ==============================================================
code   name        when
=====  ==========  ==============================================================
0      OK          the command did what it was asked
1      ERROR       Turnstile or the CLI failed (NOT_FOUND, INTERNAL, a bad config)
2      USAGE       the command line or the request was invalid (INVALID_ARGUMENT)
3      REFUSED     a limit said no: cap, rate, concurrency, node slots, tier full
4      RETRYABLE   try again soon: pending, busy, a service or dependency unavailable
=====  ==========  ==============================================================

A refusal may carry a retry hint too (a rate refusal says when tokens return);
it is still REFUSED, because a policy decided, not a transient failure.
"""

from __future__ import annotations

import enum

import grpc

from turnstile_platform.errors import RichError


class Exit(enum.IntEnum):
    OK = 0
    ERROR = 1
    USAGE = 2
    REFUSED = 3
    RETRYABLE = 4


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
    }
)

_RETRYABLE_CODES = frozenset(
    {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED}
)


def for_error(error: RichError) -> Exit:
    """The exit code of a failed call."""
    if error.reason in REFUSAL_REASONS:
        return Exit.REFUSED
    if error.reason in RETRYABLE_REASONS or error.code in _RETRYABLE_CODES:
        return Exit.RETRYABLE
    if error.code is grpc.StatusCode.RESOURCE_EXHAUSTED:
        return Exit.REFUSED
    if error.code is grpc.StatusCode.INVALID_ARGUMENT:
        return Exit.USAGE
    return Exit.ERROR
