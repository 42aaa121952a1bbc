"""Admission metrics. Every label naming a client is a bounded key (SPEC C3)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram, Summary

from turnstile_clientkeys import NATIVE, SHARED, UNATTRIBUTED, KeySet, Resolver
from turnstile_platform.metric_children import Children

DECISIONS = Counter(
    "turnstile_admission_decisions_total",
    "Admit decisions, by outcome, refusing policy (empty when admitted) and bounded key.",
    ["decision", "refused_by", "key"],
)
VERDICTS = Counter(
    "turnstile_admission_policy_verdicts_total",
    "Policy verdicts, by policy, verdict and bounded key.",
    ["policy", "verdict", "key"],
)
SHADOW_REFUSALS = Counter(
    "turnstile_admission_shadow_refusals_total",
    "Refusals recorded but not enforced: a policy in shadow mode, or a key's shadow limit "
    "(SPEC Q4), by policy and bounded key.",
    ["policy", "key"],
)
FAIL_OPEN = Counter(
    "turnstile_admission_fail_open_total",
    "Decisions a policy let through without its backend (redis, or substrate for the cap).",
    ["policy", "backend", "key"],
)
PENDING = Gauge(
    "turnstile_admission_pending_entries",
    "Pending entries of a bounded key, as the last decision for it saw them.",
    ["key"],
)
PENDING_EXPIRED = Counter(
    "turnstile_admission_pending_expired_total",
    "Pending entries dropped because they expired before the substrate's leader saw their "
    "sandbox live (a consumed entry leaves the set and is never counted): drift, by bounded key.",
    ["key"],
)
DECISION_SECONDS = Histogram(
    "turnstile_admission_decision_seconds",
    "Time to decide an Admit, live count included, by outcome.",
    ["decision"],
    buckets=(0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0),
)
UNLOGGED = Counter(
    "turnstile_admission_decisions_unlogged_total",
    "Decisions taken without Redis (by the policies' fail modes), which the decision log in "
    "Redis cannot hold: each is a log line instead (SPEC Q3), by outcome.",
    ["decision"],
)
for _outcome in ("fail_open", "fail_closed"):  # zero until it happens, so rates have series
    UNLOGGED.labels(_outcome)
HOLDS = Counter(
    "turnstile_admission_holds_total",
    "Hold commits and cancels, by action and whether the hold was still open.",
    ["action", "result"],
)

QUEUE_WAITERS = Gauge(
    "turnstile_admission_queue_waiters",
    "Waiters in the fair queue across every replica (granted, unclaimed ones included; "
    "the cluster bucket's, node slots' and per-client), as this replica's last tick saw "
    "them (0 when it has none waiting).",
)
QUEUE_LENGTH = Gauge(
    "turnstile_admission_queue_length",
    "Cluster-bucket waiters of the fair queue not yet granted across every replica, by "
    "priority level, as this replica's last tick saw them.",
    ["level"],
)
QUEUE_WAIT_SECONDS = Histogram(
    "turnstile_admission_queue_wait_seconds",
    "Time an Admit waited in the fair queue, by priority level and outcome (admitted, or "
    "refused when its budget, its deadline or the queue's room ran out).",
    ["level", "decision"],
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
)
QUEUE_GRANTS = Counter(
    "turnstile_admission_queue_grants_total",
    "Waiters admitted on a grant of the fair queue, by bounded key.",
    ["key"],
)
QUEUE_KEY_WAITERS = Gauge(
    "turnstile_admission_queue_key_waiters",
    "Calls of a bounded key waiting in the fair queue on this replica (summed over "
    "replicas: the key's queue length), whichever queue they wait in.",
    ["key"],
)
QUEUE_KEY_WAIT_SECONDS = Summary(
    "turnstile_admission_queue_key_wait_seconds",
    "Time calls of a bounded key waited in the fair queue, admitted or refused (_sum over "
    "_count: the key's mean wait; the per-level histogram has the quantiles).",
    ["key"],
)
QUEUE_FAIRNESS = Gauge(
    "turnstile_admission_queue_fairness",
    "Jain's index over the last minute of each key's fair-queue grants divided by its "
    "weighted max-min fair share of its level's grants, by priority level (1: fair; NaN: "
    "no grant in the minute). The same cluster-wide value on every replica.",
    ["level"],
)
QUEUE_SHADOW = Counter(
    "turnstile_admission_queue_shadow_total",
    "Admits with a wait budget that the rate policy's shadow mode let through and that "
    "enforcement would have queued in the fair queue, by the priority level they would "
    "have waited in (the answer says at which position; nothing joined).",
    ["level"],
)
QUEUE_REJOINED = Counter(
    "turnstile_admission_queue_rejoined_total",
    "Fair-queue waiters that joined again because Redis no longer had their entry (it "
    "restarted or failed over without it: SPEC P6), for what was left of their budget.",
)
QUEUE_SWEPT = Counter(
    "turnstile_admission_queue_swept_total",
    "Fair-queue entries a tick removed because they expired or their replica died (a "
    "waiter that leaves itself is not counted).",
)
QUEUE_RETURNED = Counter(
    "turnstile_admission_queue_returned_tokens_total",
    "Cluster-bucket tokens granted to waiters that never claimed them, given back.",
)

#: The children the decision path records into, looked up once per label values
#: (``labels()`` per call was a measurable share of an Admit: docs/performance.md).
decisions = Children(DECISIONS)
verdicts = Children(VERDICTS)
shadow_refusals = Children(SHADOW_REFUSALS)
fail_open = Children(FAIL_OPEN)
pending = Children(PENDING)
decision_seconds = Children(DECISION_SECONDS)
holds = Children(HOLDS)
queue_wait_seconds = Children(QUEUE_WAIT_SECONDS)
queue_grants = Children(QUEUE_GRANTS)
queue_key_waiters = Children(QUEUE_KEY_WAITERS)
queue_key_wait_seconds = Children(QUEUE_KEY_WAIT_SECONDS)

#: Per-key gauges: a key that left the key set must leave them too, or its last
#: value is reported forever (counters keep their history: rates need it).
PER_KEY_GAUGES = ((PENDING, pending), (QUEUE_KEY_WAITERS, queue_key_waiters))
_ALWAYS = frozenset({SHARED, NATIVE, UNATTRIBUTED})


def forget_departed_keys(keyset: KeySet) -> None:
    """Remove per-key gauge series of bounded keys ``keyset`` no longer resolves to."""
    resolver = Resolver(keyset)
    for gauge, children in PER_KEY_GAUGES:
        keys = {sample.labels["key"] for family in gauge.collect() for sample in family.samples}
        for key in keys:
            if key not in _ALWAYS and resolver.resolve_id(key).key != key:
                gauge.remove(key)
                children.forget(key)
