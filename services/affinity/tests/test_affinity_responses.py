"""The Place and ReleaseLease answers, as the servicer builds them per call.

``_placement`` fills the lease expiry into the response in place, and
``ReleaseLease`` returns one of two messages built once: each answer must be,
byte for byte, the message built field by field.
"""

from __future__ import annotations

from google.protobuf import timestamp_pb2

from turnstile_affinity.placement import Placement, PlacementOutcome, Reset, ResetReason
from turnstile_affinity.servicer import _NOT_RELEASED, _RELEASED, _placement
from turnstile_contracts import affinity_pb2

OUTCOMES = {
    PlacementOutcome.HIT: affinity_pb2.PLACEMENT_OUTCOME_HIT,
    PlacementOutcome.FIRST: affinity_pb2.PLACEMENT_OUTCOME_FIRST,
    PlacementOutcome.FALLBACK: affinity_pb2.PLACEMENT_OUTCOME_FALLBACK,
}
REASONS = {
    ResetReason.GRACE_EXPIRED: affinity_pb2.RESET_REASON_GRACE_EXPIRED,
    ResetReason.RETIERED: affinity_pb2.RESET_REASON_RETIERED,
}
LEASE = "0123456789abcdef0123456789abcdef"


def _timestamp(ms: int) -> timestamp_pb2.Timestamp:
    return timestamp_pb2.Timestamp(seconds=ms // 1000, nanos=(ms % 1000) * 1_000_000)


def field_by_field(placement: Placement) -> affinity_pb2.PlaceResponse:
    """Every field set from the placement, nothing skipped."""
    response = affinity_pb2.PlaceResponse(
        sandbox_id=placement.sandbox_id,
        tier=placement.tier,
        lease_id=placement.lease_id,
        outcome=OUTCOMES[placement.outcome],
        endpoint=placement.endpoint,
        lease_expires_at=_timestamp(placement.lease_expires_ms),
    )
    if placement.reset is not None:
        reset = placement.reset
        response.reset.CopyFrom(
            affinity_pb2.WorkspaceReset(
                from_sandbox_id=reset.from_sandbox_id,
                to_sandbox_id=reset.to_sandbox_id,
                at=_timestamp(reset.at_ms),
                reason=REASONS[reset.reason],
            )
        )
    return response


def test_every_placement_answers_the_message_built_field_by_field() -> None:
    moved = Reset("a1", "a2", 1_700_000_000_007, ResetReason.GRACE_EXPIRED)
    retiered = Reset("b1", "a2", 1_700_000_000_999, ResetReason.RETIERED)
    placements = [
        Placement("a1", "a", LEASE, 1_700_000_600_123, "", PlacementOutcome.HIT),
        Placement("a1", "a", LEASE, 1_700_000_600_000, "10.0.0.7:8080", PlacementOutcome.HIT),
        Placement("a1", "", LEASE, 0, "", PlacementOutcome.HIT),
        Placement("a2", "a", LEASE, 1_700_000_600_001, "", PlacementOutcome.FIRST),
        Placement("a2", "a", LEASE, 1_700_000_600_999, "x:1", PlacementOutcome.FALLBACK, moved),
        Placement("a2", "a", LEASE, 1_700_000_600_500, "", PlacementOutcome.FALLBACK, retiered),
    ]
    for placement in placements:
        answered, expected = _placement(placement), field_by_field(placement)
        assert answered == expected, placement
        assert answered.SerializeToString(deterministic=True) == expected.SerializeToString(
            deterministic=True
        ), placement


def test_release_answers_are_the_messages_built_per_call() -> None:
    for shared, released in ((_RELEASED, True), (_NOT_RELEASED, False)):
        expected = affinity_pb2.ReleaseLeaseResponse(released=released)
        assert shared == expected
        assert shared.SerializeToString() == expected.SerializeToString()
