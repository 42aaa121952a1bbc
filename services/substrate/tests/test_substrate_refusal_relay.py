"""Admission's refusals as Activate relays them (SPEC P7, N5): every number for the
services and operators, and a shared limit's refusal (the cluster bucket, node
slots) marked as one, so the handler hides its numbers from a scoped caller."""

from __future__ import annotations

from turnstile_contracts import admission_pb2
from turnstile_platform.shared_limits import SHARED_LIMIT, scoped
from turnstile_substrate.admission_client import refusal_error


def refused(
    policy: admission_pb2.Policy.ValueType, detail: str, limit: int, current: int
) -> admission_pb2.AdmitResponse:
    response = admission_pb2.AdmitResponse(
        decision=admission_pb2.DECISION_REFUSED,
        refused_by=policy,
        limit=limit,
        current=current,
        message=f"refused for key acme: {current} of {limit}",
    )
    response.key.key = "acme"
    response.verdicts.add(
        policy=policy,
        mode=admission_pb2.POLICY_MODE_ENFORCE,
        verdict=admission_pb2.VERDICT_REFUSE,
        limit=limit,
        current=current,
        detail=detail,
    )
    response.retry_after.FromMilliseconds(2000)
    return response


def test_node_slots_and_the_cluster_bucket_are_marked_shared_with_their_numbers() -> None:
    slots = refusal_error(refused(admission_pb2.POLICY_NODE_SLOTS, "", 32, 32), 5.0)
    cluster = refusal_error(refused(admission_pb2.POLICY_RATE, "cluster bucket", 2, 0), 5.0)
    assert slots.metadata[SHARED_LIMIT] == "node slots"
    assert cluster.metadata[SHARED_LIMIT] == "cluster bucket"
    assert (slots.metadata["limit"], slots.metadata["current"]) == ("32", "32")
    hidden = scoped(slots)
    assert hidden.message == "the cluster is contended, retry in 2 s"
    assert not {"limit", "current", SHARED_LIMIT} & set(hidden.metadata)
    assert hidden.reason == slots.reason == "NODE_SLOTS_EXHAUSTED"


def test_the_keys_own_limits_are_not_marked() -> None:
    own_bucket = refusal_error(refused(admission_pb2.POLICY_RATE, "client bucket", 2, 0), 5.0)
    cap = refusal_error(refused(admission_pb2.POLICY_CAP, "", 2, 2), 5.0)
    assert SHARED_LIMIT not in own_bucket.metadata
    assert SHARED_LIMIT not in cap.metadata


def test_a_fail_closed_shared_policy_is_not_told_as_contention() -> None:
    """Node slots failing closed (their store unreachable) counted nothing: the
    refusal stays UNAVAILABLE with its own words, not "the cluster is contended"."""
    response = refused(admission_pb2.POLICY_NODE_SLOTS, "POLICY_BACKEND_UNAVAILABLE", 0, 0)
    response.verdicts[0].verdict = admission_pb2.VERDICT_UNKNOWN
    error = refusal_error(response, 5.0)
    assert error.reason == "POLICY_BACKEND_UNAVAILABLE"
    assert SHARED_LIMIT not in error.metadata
