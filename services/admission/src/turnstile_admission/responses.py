"""``AdmitResponse`` messages from decisions, the fixed part of each built once per
decision shape.

Building a response field by field (four verdicts added, the key's fields set)
was the largest share of admission's own Python per Admit. Most of it depends
only on the decision's shape (``Decision.shape``: the key, the outcome, the
activation's plan and each verdict): the key, the outcome, every verdict's policy,
mode and verdict, the SKIPPED verdicts whole, the refusing policy. That part is
built once per shape as a template; each Admit copies its template (one C call)
and sets what is its own: the key set's version, the evaluated verdicts' limits,
counts and details, the node, the message, the hold or the refusal's figures.
The result is the same message, byte for byte, as one built field by field
(``test_admission_responses.py``).
"""

from __future__ import annotations

from collections.abc import Hashable

from turnstile_admission.decision import Decision
from turnstile_admission.policies import Mode, PolicyName, Verdict
from turnstile_clientkeys.contract import KEY_KINDS
from turnstile_contracts import admission_pb2
from turnstile_platform.shared_limits import CLUSTER_BUCKET, CONTENDED, contended

POLICIES = {
    PolicyName.CAP: admission_pb2.POLICY_CAP,
    PolicyName.RATE: admission_pb2.POLICY_RATE,
    PolicyName.CONCURRENCY: admission_pb2.POLICY_CONCURRENCY,
    PolicyName.SLOTS: admission_pb2.POLICY_NODE_SLOTS,
}
MODES = {
    Mode.OFF: admission_pb2.POLICY_MODE_OFF,
    Mode.SHADOW: admission_pb2.POLICY_MODE_SHADOW,
    Mode.ENFORCE: admission_pb2.POLICY_MODE_ENFORCE,
}
VERDICTS = {
    Verdict.PASS: admission_pb2.VERDICT_PASS,
    Verdict.REFUSE: admission_pb2.VERDICT_REFUSE,
    Verdict.SHADOW_REFUSE: admission_pb2.VERDICT_SHADOW_REFUSE,
    Verdict.UNKNOWN: admission_pb2.VERDICT_UNKNOWN,
    Verdict.SKIPPED: admission_pb2.VERDICT_SKIPPED,
}

_MILLIS_PER_SECOND = 1000
_NANOS_PER_MILLI = 1_000_000


class _Template:
    __slots__ = ("measured", "message")

    def __init__(self, message: admission_pb2.AdmitResponse, measured: tuple[int, ...]) -> None:
        self.message = message
        #: The verdicts whose limit, count and detail are the call's own (all but
        #: the SKIPPED ones, which the shape fixes whole).
        self.measured = measured


class AdmitResponses:
    """The response of each decision, from a template per decision shape.

    Shapes are bounded by the keys (SPEC C3) times the verdicts, as the metric
    shapes ``Admitter._record`` keeps; one instance per admitter, since a shape
    is its admitter's (the plan in it fixes modes and skip reasons)."""

    def __init__(self) -> None:
        self._templates: dict[Hashable, _Template] = {}

    def response(self, decision: Decision) -> admission_pb2.AdmitResponse:
        shape = decision.shape
        template = self._templates.get(shape) if shape is not None else None
        if template is None:
            template = _template(decision)
            if shape is not None:
                self._templates[shape] = template
        response = admission_pb2.AdmitResponse()
        response.CopyFrom(template.message)
        bounded = decision.key
        if bounded.version:
            response.key.key_set_version = bounded.version
        if template.measured:
            decided = decision.verdicts
            verdicts = response.verdicts
            for i in template.measured:
                v = decided[i]
                out = verdicts[i]
                out.limit = v.limit
                out.current = v.current
                if v.detail:
                    out.detail = v.detail
        if decision.node:
            response.node = decision.node
        response.message = decision.message
        if decision.queue_position or decision.waited_s is not None:
            _queue(response, decision)
        if decision.shadow:
            add = response.shadow_verdicts.add
            for sv in decision.shadow:
                add(
                    policy=POLICIES[sv.policy],
                    verdict=VERDICTS[sv.verdict],
                    limit=sv.limit,
                    current=sv.current,
                )
        if decision.admitted and not decision.dry_run:
            response.hold_id = decision.hold_id
            # Timestamp.FromMilliseconds's arithmetic, without its range check: the
            # expiry is the script's clock plus the hold's TTL.
            expires = response.hold_expires_at
            ms = decision.hold_expires_ms
            expires.seconds = ms // _MILLIS_PER_SECOND
            expires.nanos = (ms % _MILLIS_PER_SECOND) * _NANOS_PER_MILLI
            return response
        refused = decision.refused_by
        if refused is not None:
            response.limit = refused.limit
            response.current = refused.current
            retry = decision.retry_after_s or 1.0
            response.retry_after.FromMilliseconds(max(1, round(retry * 1000)))
        return response


def _queue(response: admission_pb2.AdmitResponse, decision: Decision) -> None:
    """What the fair queue adds to the answer of a call that joined it (or would
    have: a dry run's, a shadow mode's, with no wait)."""
    if decision.waited_s is not None:
        response.waited.FromMilliseconds(round(decision.waited_s * 1000))
    if decision.queue_position:
        response.queue_position = decision.queue_position
    if decision.estimated_wait_s is not None:
        response.estimated_wait.FromMilliseconds(round(decision.estimated_wait_s * 1000))


def _template(decision: Decision) -> _Template:
    """What every decision of ``decision``'s shape answers alike."""
    admitted = decision.admitted
    message = admission_pb2.AdmitResponse(
        decision=admission_pb2.DECISION_ADMITTED if admitted else admission_pb2.DECISION_REFUSED,
        dry_run=decision.dry_run,
    )
    key = message.key
    key.key = decision.key.key
    key.kind = KEY_KINDS[decision.key.kind]
    measured = []
    add = message.verdicts.add
    for i, v in enumerate(decision.verdicts):
        out = add(policy=POLICIES[v.policy], mode=MODES[v.mode], verdict=VERDICTS[v.verdict])
        if v.verdict is Verdict.SKIPPED:
            out.limit = v.limit
            out.current = v.current
            out.detail = v.detail
        else:
            measured.append(i)
    refused = decision.refused_by
    if not admitted and refused is not None:
        message.refused_by = POLICIES[refused.policy]
    return _Template(message, tuple(measured))


_SHOWN_VERDICTS = (admission_pb2.VERDICT_REFUSE, admission_pb2.VERDICT_SHADOW_REFUSE)


def hide_shared(verdict: admission_pb2.PolicyVerdict) -> bool:
    """Clear what ``verdict`` says of a shared limit (SPEC N5): the node slots'
    held and total, the cluster bucket's level and capacity (a rate verdict the
    cluster bucket gave). True when it was a shared limit's verdict."""
    if verdict.verdict == admission_pb2.VERDICT_SKIPPED:
        return False
    slots = verdict.policy == admission_pb2.POLICY_NODE_SLOTS
    if not slots and not (
        verdict.policy == admission_pb2.POLICY_RATE and verdict.detail == CLUSTER_BUCKET
    ):
        return False
    verdict.ClearField("limit")
    verdict.ClearField("current")
    if verdict.verdict in _SHOWN_VERDICTS:
        verdict.detail = CONTENDED
    elif slots and verdict.detail in ("", "waiters first"):
        verdict.ClearField("detail")
    return True


def hide_shared_in_answer(response: admission_pb2.AdmitResponse) -> None:
    """``response`` as a scoped caller reads it (SPEC N5): the shared limits'
    verdicts without their numbers and, when one of them refused, the refusal's
    limit, current value and words replaced by "the cluster is contended, retry in
    …". The caller's own limits keep every number."""
    refusing = None
    for verdict in response.verdicts:
        shared = hide_shared(verdict)
        if shared and response.refused_by == verdict.policy:
            refusing = verdict
    if refusing is None or response.decision == admission_pb2.DECISION_ADMITTED:
        return
    response.ClearField("limit")
    response.ClearField("current")
    retry = (
        response.retry_after.ToMilliseconds() / 1000 if response.HasField("retry_after") else None
    )
    words = contended(retry)
    response.message = f"dry run: {words} (nothing was taken)" if response.dry_run else words
