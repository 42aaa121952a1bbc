"""Prometheus metrics of the affinity service.

Labels are bounded: outcomes and reasons are fixed sets, and ``tier`` is a
declared tier (or ``*`` when no tiers are configured and nothing is filtered).
Sessions and sandboxes are never labels; they are span attributes.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge

from turnstile_platform.metric_children import Children

PLACEMENTS = Counter(
    "turnstile_affinity_placements_total",
    "Place calls by outcome: hit, first, fallback, busy, pending, exhausted.",
    ["tier", "outcome"],
)
RESETS = Counter(
    "turnstile_affinity_workspace_resets_total",
    "Sessions moved to a fresh workspace, by reason (grace_expired, retiered).",
    ["tier", "reason"],
)
WAKES = Counter(
    "turnstile_affinity_wakes_total",
    "Wakes of absent sandboxes through substrate Activate, by result "
    "(activated, already_running, refused, failed, not_owned: the sandbox is "
    "recorded to another client than the session's).",
    ["result"],
)
PREPARES = Counter(
    "turnstile_affinity_prepares_total",
    "Prepare calls (SPEC W2) by outcome: running, wake_started, already_waking, "
    "no_session, will_move, not_woken (wakes are off).",
    ["outcome"],
)
LEASES = Counter(
    "turnstile_affinity_leases_total",
    "Leases taken and returned: acquired, released (ReleaseLease), "
    "returned (a Place that failed or was cancelled after taking one).",
    ["event"],
)
#: The children Place and ReleaseLease record into, looked up once per label values.
placements = Children(PLACEMENTS)
leases = Children(LEASES)
#: The lease events every turn counts, looked up once: no series of LEASES is ever
#: removed, and a lookup per call cost 0.15 µs (docs/performance.md).
LEASES_ACQUIRED = leases("acquired")
LEASES_RELEASED = leases("released")
ATTACHED = Gauge(
    "turnstile_affinity_relay_streams",
    "Worker streams attached to this replica's relay.",
)
ATTACHES = Counter(
    "turnstile_affinity_relay_attaches_total",
    "Worker streams this replica's relay attached, by whether the Hello took over a "
    "live presence (takeover) or not (new): churn shows as attaches outpacing streams.",
    ["kind"],
)
WAITING = Gauge(
    "turnstile_affinity_relay_streams_waiting_for_hello",
    "Attach streams open on this replica whose Hello is not accepted yet (they hold no "
    "stream slot; SPEC O6).",
)
CLOSED_BEFORE_HELLO = Counter(
    "turnstile_affinity_relay_streams_closed_before_hello_total",
    "Attach streams closed before their Hello was accepted: hello_timeout (none within "
    "TURNSTILE_RELAY_HELLO_TIMEOUT_S) or pushed_out (the longest waiting, when one more "
    "came past TURNSTILE_RELAY_MAX_WAITING_FOR_HELLO).",
    ["why"],
)
DROPPED = Counter(
    "turnstile_affinity_relay_messages_dropped_total",
    "Worker heartbeats and renewals dropped unanswered, past their stream's budget "
    "(no Redis script, no signature check), by kind (heartbeat, renewal).",
    ["kind"],
)
EXCLUDED = Counter(
    "turnstile_affinity_excluded_workers_total",
    "Workers attached without a declared tier label (excluded from placement), "
    "counted once per sandbox id per replica.",
    ["why"],
)
CREDENTIAL_REFUSALS = Counter(
    "turnstile_affinity_credential_refusals_total",
    "Worker Hellos and renewals refused for their sandbox credential (SPEC Z3), by why: "
    "missing, malformed, unknown_key, bad_signature, wrong_sandbox, expired, "
    "not_yet_valid, revoked.",
    ["why"],
)
PRESENCE_OVERRIDES = Counter(
    "turnstile_affinity_presence_overrides_total",
    "Worker Hellos whose tier, capacity or endpoint contradicted the sandbox's credential "
    "and were overridden, or whose capacity was above the tier's bound (SPEC O3), by why: "
    "tier, capacity, endpoint, capacity_bound.",
    ["why"],
)
