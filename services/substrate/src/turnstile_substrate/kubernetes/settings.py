"""Settings of the Kubernetes substrate, read from ``TURNSTILE_K8S_*`` variables.

Every knob has its default on its field. The substrate service nests or builds
one :class:`KubernetesSettings`; tests build it with ``api_host`` pointing at the
API-server emulator.
"""

from __future__ import annotations

from pydantic import AliasChoices, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from turnstile_clientkeys import is_label_value
from turnstile_substrate.kubernetes.tier_runtime import TierRuntime, check_quantity
from turnstile_substrate.runtime import LABEL_MANAGED_BY, LABEL_NAME, MANAGED_BY

DEFAULT_LABEL_SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY}"

#: Label keys Turnstile sets itself; ``extra_labels`` may not set them (a warm pod
#: with a sandbox-id label, or a pod outside the reflector's selector, would break it).
_RESERVED_PREFIX = "turnstile.dev/"
_RESERVED_KEYS = frozenset({LABEL_MANAGED_BY, LABEL_NAME})

#: The runtime of a tier absent from ``tier_runtimes``: the shared template, no warm pool.
_SHARED = TierRuntime()


class KubernetesSettings(BaseSettings):
    """Where pods live, what they look like, the warm pool and the reflector's timing."""

    model_config = SettingsConfigDict(
        env_prefix="TURNSTILE_K8S_", extra="ignore", frozen=True, validate_default=True
    )

    # ------------------------------------------------------------------ connection

    api_host: str | None = None
    """An API server URL used as is, without credentials (``http://127.0.0.1:PORT``);
    meant for the test emulator and ``kubectl proxy``. Unset: in-cluster or kubeconfig."""

    in_cluster: bool | None = None
    """Use the pod's service account. Unset: in-cluster when ``KUBERNETES_SERVICE_HOST``
    is set, kubeconfig otherwise."""

    kubeconfig: str | None = None
    """Path of the kubeconfig file; unset uses ``$KUBECONFIG`` or ``~/.kube/config``."""

    context: str | None = None
    """kubeconfig context; unset uses the current context."""

    namespace: str = Field(default="turnstile-sandboxes", min_length=1, max_length=63)
    """Namespace of every sandbox pod; the reflector watches only it."""

    request_timeout_s: float = Field(default=10.0, gt=0, le=120)
    """Deadline of one non-watch API call (create, patch, delete, one list page)."""

    # ------------------------------------------------------------------ pod template

    image: str = Field(default="ghcr.io/turnstile/sandbox-runtime:latest", min_length=1)
    """Container image of a sandbox runtime."""

    image_pull_policy: str = "IfNotPresent"
    """``imagePullPolicy`` of the runtime container."""

    container_name: str = "runtime"
    """Name of the runtime container."""

    cpu_request: str = "250m"
    """CPU request of the runtime container; empty leaves it out. This and the three below
    are every tier's unless ``tier_runtimes`` sets the tier's own."""

    memory_request: str = "512Mi"
    """Memory request of the runtime container; empty leaves it out."""

    cpu_limit: str = ""
    """CPU limit of the runtime container; empty (the default) sets none."""

    memory_limit: str = "1Gi"
    """Memory limit of the runtime container; empty sets none."""

    service_account: str = ""
    """``serviceAccountName`` of sandbox pods; empty uses the namespace default."""

    termination_grace_s: int = Field(default=10, ge=0, le=3600)
    """``terminationGracePeriodSeconds`` of sandbox pods."""

    extra_labels: dict[str, str] = Field(default_factory=dict)
    """Labels put on every pod besides Turnstile's own (JSON object). A term added to
    ``label_selector`` must be satisfied by these. ``turnstile.dev/*``,
    ``app.kubernetes.io/managed-by`` and ``app.kubernetes.io/name`` are Turnstile's."""

    run_as_user: int = Field(default=10001, ge=1)
    """``runAsUser`` of sandbox pods (non-root: the namespace enforces the restricted
    Pod Security Standard). 10001 is the user of the Turnstile images."""

    run_as_group: int = Field(default=10001, ge=0)
    """``runAsGroup`` of sandbox pods."""

    tmp_size_limit: str = "256Mi"
    """``sizeLimit`` of the emptyDir mounted on ``/tmp`` (the root filesystem is read-only);
    empty sets none."""

    # ------------------------------------------------------------------ tiers

    tier_runtimes: dict[str, TierRuntime] = Field(default_factory=dict)
    """What each tier runs on (JSON object, tier → settings; :mod:`.tier_runtime`):
    ``runtime_class_name``, ``cpu_request``, ``memory_request``, ``cpu_limit``,
    ``memory_limit`` (unset: the values above), ``node_selector``, ``tolerations`` and
    ``warm_pool_size`` (0: no warm pool). A tier absent from it runs the shared template
    without a warm pool. Example: ``{"container": {"warm_pool_size": 8}, "microvm":
    {"runtime_class_name": "kata", "memory_limit": "2Gi", "warm_pool_size": 2}}``. Each key
    must be a declared tier (``TURNSTILE_TIERS``) when tiers are declared."""

    # ------------------------------------------------------------------ worker agent

    affinity_addr: str = Field(
        default="127.0.0.1:50053",
        validation_alias=AliasChoices(
            "TURNSTILE_K8S_AFFINITY_ADDR", "TURNSTILE_AFFINITY_ADDR", "affinity_addr"
        ),
    )
    """Where the worker in a sandbox pod reaches the affinity relay
    (``TURNSTILE_AFFINITY_ADDR`` of the runtime container). Unset: the substrate's own
    ``TURNSTILE_AFFINITY_ADDR``, right when sandbox pods share the services' namespace;
    from another namespace, name the Service fully (``turnstile-affinity.turnstile.svc:50053``)."""

    affinity_spiffe_id: str = Field(
        default="spiffe://turnstile.local/service/affinity",
        validation_alias=AliasChoices(
            "TURNSTILE_K8S_AFFINITY_SPIFFE_ID", "TURNSTILE_AFFINITY_SPIFFE_ID", "affinity_spiffe_id"
        ),
    )
    """The SPIFFE ID the worker in a sandbox pod requires of the relay's certificate
    (``TURNSTILE_AFFINITY_SPIFFE_ID`` of the runtime container, SPEC O5). Unset: the
    substrate's own ``TURNSTILE_AFFINITY_SPIFFE_ID``."""

    worker_capacity: int = Field(default=1, ge=1, le=1024)
    """Concurrent turns each sandbox's worker serves (``TURNSTILE_WORKER_CAPACITY``),
    attested in its credential (SPEC O3)."""

    worker_port: int | None = Field(default=None, ge=1, le=65535)
    """The port each sandbox's worker serves turns on. With it, a sandbox's credential
    attests the endpoint ``<pod IP>:<port>`` (SPEC O3), bound by the renewal once the pod
    has an IP; unset, the endpoint is empty (Place returns none)."""

    worker_tls_secret: str = Field(default="", max_length=253)
    """A Secret (``tls.crt``, ``tls.key``, ``ca.crt``: cert-manager's layout) holding the
    sandbox-class certificate, mounted read-only in every sandbox pod for the worker's
    mTLS channel to the relay (``TURNSTILE_WORKER_TLS_*``). One Secret for all pods:
    it proves only "a sandbox runtime", which the policy lets call ``Attach`` alone.
    Empty mounts none (the worker then cannot reach an mTLS relay)."""

    name_prefix: str = Field(default="ts", pattern=r"^[a-z0-9]([-a-z0-9]{0,14}[a-z0-9])?$")
    """Prefix of pod names: ``<prefix>-<sandbox>-<random>``, ``<prefix>-warm-<tier>-<random>``."""

    # ------------------------------------------------------------------ placement

    nodes: tuple[str, ...] = ()
    """Candidate nodes a cold create may land on, reported to admission's node-slot
    policy (JSON list). Empty: no candidates are reported and the slot check does not
    apply. Pods are not pinned; the scheduler still places them."""

    # ------------------------------------------------------------------ credentials

    credential_renew_rate: float = Field(default=20.0, gt=0, le=10_000)
    """Most credential Secret writes (renewals and orphan deletions) per second the leader's
    renewal pass makes, so 10,000 sandboxes never storm the API server: at the default ttl
    (3600 s) they need about 6 a second. Used only with sandbox credentials on
    (``TURNSTILE_WORKER_CREDENTIAL_SIGNING_KEY_FILE``)."""

    credential_orphan_grace_s: float = Field(default=120.0, ge=0, le=86_400)
    """How old a credential Secret whose pod is gone (or belongs to another sandbox) must be
    before the renewal pass deletes it: a cold create makes the Secret just before its pod."""

    # ------------------------------------------------------------------ warm pool

    warm_pool_interval_s: float = Field(default=2.0, gt=0, le=300)
    """Longest wait between two warm-pool refill checks; a claim or a change the
    reflector sees wakes the loop sooner."""

    warm_refill_admitted: bool = True
    """Reserve each warm pod's creation with admission's ``ReserveWarm`` (a cluster
    token, a node slot of ``nodes``) before making it (SPEC W3), so the refill never
    takes what activations need; false: the tiers' sizes are its only bound."""

    warm_claim_spread: int = Field(default=8, ge=1, le=1000)
    """A claim takes a warm pod at random among this many oldest claimable ones, so
    replicas claiming at once mostly try different pods; 1 always takes the oldest."""

    warm_require_running: bool = True
    """Only claim warm pods whose phase is Running (started and scheduled). False also
    claims Pending ones: faster hand-out, but the sandbox may wait for its pod."""

    # ------------------------------------------------------------------ sweeps

    sweep_interval_s: float = Field(default=30.0, gt=0, le=3600)
    """How often the leader runs the sweeps (orphan, finished and expired warm pods;
    records whose pod is gone)."""

    sweep_orphan_grace_s: float = Field(default=120.0, ge=0, le=86_400)
    """A pod no record names is an orphan only once this old: longer than any activation
    takes from create to record, so an activation in flight is never swept."""

    sweep_warm_max_age_s: float = Field(default=3600.0, ge=0, le=604_800)
    """Unclaimed warm pods older than this are replaced (the refill makes new ones with
    the current template); 0 keeps them forever."""

    sweep_dry_run: bool = False
    """Find and count (metrics, logs) without deleting pods or ending records."""

    # ------------------------------------------------------------------ leader election

    leader_lease_name: str = Field(
        default="turnstile-substrate-leader", pattern=r"^[a-z0-9]([-a-z0-9.]{0,251}[a-z0-9])?$"
    )
    """Name of the ``coordination.k8s.io/v1`` Lease the substrate replicas elect their
    leader with; only the leader refills and trims the warm pool and runs the sweeps."""

    leader_lease_namespace: str = Field(default="", max_length=63)
    """Namespace of that Lease; empty: ``namespace`` (where the substrate's Role already
    applies)."""

    leader_identity: str = Field(default="", max_length=128)
    """This replica's holder identity; empty: ``$POD_NAME`` (else the hostname) plus a
    random suffix, unique per process."""

    leader_lease_duration_s: float = Field(default=15.0, ge=1, le=300)
    """How long a lease not renewed stays held: a dead leader is replaced within it."""

    leader_renew_deadline_s: float = Field(default=10.0, gt=0, le=300)
    """A leader that could not renew for this long stops its leader-only work (before the
    lease can pass to another replica). Must be below ``leader_lease_duration_s``."""

    leader_retry_period_s: float = Field(default=2.0, gt=0, le=60)
    """How often the leader renews and the others try to acquire. Must be below
    ``leader_renew_deadline_s``."""

    # ------------------------------------------------------------------ reflector

    label_selector: str = DEFAULT_LABEL_SELECTOR
    """Which pods the reflector lists and watches. Every pod the substrate creates
    carries ``app.kubernetes.io/managed-by=turnstile``."""

    list_page_size: int = Field(default=500, ge=1, le=10_000)
    """Pods per page of the reflector's list (``limit`` + ``continue``)."""

    watch_timeout_s: int = Field(default=300, ge=1, le=3600)
    """``timeoutSeconds`` of one watch; when it ends cleanly the reflector resumes from
    the last resourceVersion it saw, without re-listing."""

    watch_read_grace_s: float = Field(default=30.0, gt=0, le=600)
    """How much longer than ``watch_timeout_s`` a silent watch connection may stay open
    before the reflector declares it dead and re-lists."""

    relist_backoff_s: float = Field(default=0.5, gt=0, le=60)
    """First wait before re-listing after an error; doubles up to ``relist_backoff_max_s``."""

    relist_backoff_max_s: float = Field(default=15.0, gt=0, le=600)
    """Longest wait between re-list attempts while the API server fails."""

    @field_validator("tier_runtimes")
    @classmethod
    def _tiers(cls, value: dict[str, TierRuntime]) -> dict[str, TierRuntime]:
        for tier in value:
            if not is_label_value(tier):
                raise ValueError(f"tier {tier!r} is not a valid label value")
        return value

    @field_validator("cpu_request", "memory_request", "cpu_limit", "memory_limit")
    @classmethod
    def _quantity(cls, value: str) -> str:
        check_quantity(value)
        return value

    @field_validator("extra_labels")
    @classmethod
    def _extra_labels(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if key.startswith(_RESERVED_PREFIX) or key in _RESERVED_KEYS:
                raise ValueError(f"label {key!r} is set by Turnstile itself")
            if not key or (label and not is_label_value(label)):
                raise ValueError(f"label {key!r}: {label!r} is not a valid label value")
        return value

    @model_validator(mode="after")
    def _backoff(self) -> KubernetesSettings:
        if self.relist_backoff_max_s < self.relist_backoff_s:
            raise ValueError("relist_backoff_max_s must be at least relist_backoff_s")
        if not (
            self.leader_retry_period_s < self.leader_renew_deadline_s < self.leader_lease_duration_s
        ):
            raise ValueError(
                "leader election needs leader_retry_period_s < leader_renew_deadline_s "
                "< leader_lease_duration_s"
            )
        return self

    def tier_runtime(self, tier: str) -> TierRuntime:
        """What ``tier``'s pods run on (the shared template when it names none)."""
        return self.tier_runtimes.get(tier, _SHARED)

    def warm_size(self, tier: str) -> int:
        """The configured warm-pool size of ``tier`` (0 when none)."""
        return self.tier_runtime(tier).warm_pool_size

    def warm_tiers(self) -> list[str]:
        """Tiers with a warm pool configured (a static size, or autosizing)."""
        return [
            tier
            for tier, runtime in self.tier_runtimes.items()
            if runtime.warm_pool_size or runtime.warm_autosize
        ]

    def undeclared_tiers(self, declared: tuple[str, ...]) -> list[str]:
        """Tiers of ``tier_runtimes`` that are not among ``declared`` (a typo, or a tier
        that was removed); none when no tiers are declared."""
        if not declared:
            return []
        return [tier for tier in self.tier_runtimes if tier not in declared]
