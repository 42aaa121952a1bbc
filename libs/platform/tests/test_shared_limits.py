"""What a scoped caller reads of a shared limit's refusal (SPEC N5): the words
"the cluster is contended" and the retry hint, never the limit's numbers; an
unscoped caller (an operator, a service) reads the refusal as it was raised."""

from __future__ import annotations

import asyncio

import grpc

from turnstile_platform import shared_limits
from turnstile_platform.authz.ownership import CallerScope, enter_scope
from turnstile_platform.authz.policy import AuthzDecision
from turnstile_platform.errors import QuotaViolation, RichError

REFUSAL = RichError(
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    "refused by rate for key acme: 0 of 2 (cluster bucket)",
    reason="RATE_LIMITED",
    metadata={
        "key": "acme",
        "policy": "rate",
        "limit": "2",
        "current": "0",
        shared_limits.SHARED_LIMIT: shared_limits.CLUSTER_BUCKET,
    },
    retry_after_s=2.2,
    quota_violations=(QuotaViolation("acme", "rate: current 0 of limit 2"),),
)
OWN = RichError(
    grpc.StatusCode.RESOURCE_EXHAUSTED,
    "refused by cap for key acme: 2 of 2",
    reason="CAP_EXCEEDED",
    metadata={"key": "acme", "policy": "cap", "limit": "2", "current": "2"},
)


def scoped_to_acme() -> None:
    decision = AuthzDecision(allowed=True, clients=frozenset({"acme"}))
    enter_scope(CallerScope("spiffe://t/client/acme", "/m", decision, lambda why: None))


async def as_tenant(error: RichError) -> tuple[RichError, str, str]:
    async def call() -> tuple[RichError, str, str]:
        scoped_to_acme()
        return (
            shared_limits.for_caller(error),
            shared_limits.detail_for_caller(shared_limits.log_detail(error.message)),
            shared_limits.detail_for_caller(OWN.message),
        )

    return await asyncio.create_task(call())  # a call's own context, as gRPC gives it


async def test_a_scoped_caller_reads_contended_and_the_retry_hint_alone() -> None:
    error, logged, own = await as_tenant(REFUSAL)
    assert error.message == "the cluster is contended, retry in 3 s"
    assert error.metadata == {"key": "acme", "policy": "rate"}
    assert (error.code, error.reason, error.retry_after_s) == (
        REFUSAL.code,
        REFUSAL.reason,
        REFUSAL.retry_after_s,
    )
    assert error.quota_violations == (QuotaViolation("cluster", "the cluster is contended"),)
    assert logged == "the cluster is contended"
    assert own == OWN.message


async def test_a_scoped_caller_reads_its_own_limits_whole() -> None:
    error, _, _ = await as_tenant(OWN)
    assert error is OWN


def test_an_unscoped_caller_reads_the_shared_limit_whole() -> None:
    assert shared_limits.for_caller(REFUSAL) is REFUSAL
    logged = shared_limits.log_detail(REFUSAL.message)
    assert shared_limits.detail_for_caller(logged) == logged
    assert REFUSAL.message in logged
