"""Prometheus metrics of the Kubernetes substrate.

Labels are bounded: tiers come from settings, reasons and event types are fixed
sets. No metric here names a client.
"""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

REFLECTOR_EVENTS = Counter(
    "turnstile_substrate_reflector_events_total",
    "Watch events the reflector applied, by type (ADDED, MODIFIED, DELETED, BOOKMARK).",
    ["type"],
)
REFLECTOR_RELISTS = Counter(
    "turnstile_substrate_reflector_relists_total",
    "Re-lists after a failed watch or list, by reason (gone, disconnect, error).",
    ["reason"],
)
REFLECTOR_WATCHES = Counter(
    "turnstile_substrate_reflector_watches_total",
    "Watches that ended, by how (clean: the server's timeout; failures re-list instead).",
    ["end"],
)
LIVE_COUNTS_CURRENT = Gauge(
    "turnstile_substrate_live_counts_current",
    "1 while this replica leads and has marked the live counts in Redis current, else 0.",
)
LIVE_COUNTS_RESYNCS = Counter(
    "turnstile_substrate_live_counts_resyncs_total",
    "Full resyncs of the live counts in Redis (taking over, after a re-list or key-set change).",
)
LIVE_COUNTS_CHANGES = Counter(
    "turnstile_substrate_live_counts_changes_total",
    "Sandbox ids the leader wrote to the live counts in Redis, by op (set, del).",
    ["op"],
)
REFLECTOR_PODS = Gauge(
    "turnstile_substrate_reflector_pods",
    "Pods in the reflector's cache after its last list or watch.",
)
REFLECTOR_LIST_SECONDS = Histogram(
    "turnstile_substrate_reflector_list_seconds",
    "Duration of one full (paged) list.",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
)
WARM_CLAIMS = Counter(
    "turnstile_substrate_warm_claims_total",
    "Warm-pool claims by tier and result (adopted, failed).",
    ["tier", "result"],
)
WARM_INVALIDATIONS = Counter(
    "turnstile_substrate_warm_invalidations_total",
    "Warm pods discarded, by tier and reason: after a failed adoption (SPEC S6: conflict, "
    "not_found, error), or made from a template the tier no longer has (stale_template).",
    ["tier", "reason"],
)
WARM_REFILL_REFUSALS = Counter(
    "turnstile_substrate_warm_refill_refusals_total",
    "Warm pods the leader's refill did not create because admission's ReserveWarm kept "
    "the capacity for activations (SPEC W3), by tier and what refused (queue, "
    "cluster_bucket, node_slots; unavailable: admission could not be asked).",
    ["tier", "reason"],
)
WARM_CREATED = Counter(
    "turnstile_substrate_warm_pods_created_total",
    "Warm pods the refill loop created, by tier.",
    ["tier"],
)
COLD_CREATES = Counter(
    "turnstile_substrate_pods_created_total",
    "Sandbox pods created cold (including restores), by tier and result (created, failed, "
    "refused: the cap gate refused before the create, already_exists: an earlier attempt at "
    "the same activation had made it).",
    ["tier", "result"],
)
SWEEPS = Counter(
    "turnstile_substrate_sweep_total",
    "What the leader's sweeps found and did (SPEC F4), by sweep (gone_runtimes, "
    "gone_runtimes_watch: the same at once for a pod the reflector saw go, finished_pods, "
    "expired_warm_pods, orphan_pods) and action (found, removed, adopted, error).",
    ["sweep", "action"],
)
SWEEP_RUNS = Counter(
    "turnstile_substrate_sweep_runs_total",
    "Sweep passes run by the leader, by result (ok, error).",
    ["result"],
)
CREDENTIAL_WRITES = Counter(
    "turnstile_substrate_credential_secrets_total",
    "Sandbox credential Secret writes (SPEC Z3), by kind (issued: before a cold create or warm "
    "adoption, renewed and swept: by the leader's renewal pass, failed: a pass's write failed).",
    ["kind"],
)
WARM_POOL = Gauge(
    "turnstile_substrate_warm_pool",
    "The leader's warm-pool sizing per tier (SPEC W1), by term: demand and forecast (warm pods "
    "wanted per second), ready_seconds (smoothed time a new pod took to become ready), target "
    "and size (warm pods available or on their way).",
    ["tier", "term"],
)
WARM_DEMAND = Counter(
    "turnstile_substrate_warm_demand_total",
    "Sandbox pods the leader saw appear in a tier with a warm pool, by result (hit: a warm pod "
    "was adopted, miss: a cold create a warm pod would have served).",
    ["tier", "result"],
)
WARM_IDLE_SECONDS = Counter(
    "turnstile_substrate_warm_idle_pod_seconds_total",
    "Pod-seconds warm pods of a tier spent ready and unclaimed (what the pool costs), as the "
    "leader's refill passes integrate them.",
    ["tier"],
)
