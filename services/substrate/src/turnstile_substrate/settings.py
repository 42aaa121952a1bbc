"""Settings of the substrate service (``TURNSTILE_*``); shared ones come from the platform."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_core import MultiHostUrl

from turnstile_platform.settings import PostgresUrl
from turnstile_platform.tiers import TieredSettings

SubstrateKind = Literal["direct", "kubernetes"]
DatabaseSslMode = Literal["disable", "prefer", "require", "verify-ca", "verify-full"]


class SubstrateSettings(TieredSettings):
    """Every substrate knob with its default."""

    port: int = Field(default=50052, ge=0, le=65535)
    metrics_port: int = Field(default=9092, ge=0, le=65535)

    substrate_kind: SubstrateKind = "direct"
    """Which substrate runs sandbox runtimes: ``direct`` (host processes, the
    embedded default for local runs) or ``kubernetes`` (pods)."""

    database_url: PostgresUrl = Field(
        default=MultiHostUrl("postgresql://postgres@127.0.0.1:5432/turnstile"), repr=False
    )
    """PostgreSQL holding sandbox records, executions and receipts. The schema is
    applied by ``turnstile-migrate`` (same variable), never by the service itself.
    Several hosts (``h1:5432,h2:5432``) with ``?target_session_attrs=read-write``
    connect to whichever is the primary, again after a failover. Keep the password
    out of it: use ``database_password_file``."""
    database_password_file: Path | None = None
    """A file holding the PostgreSQL password (a mounted Secret); read at start."""

    database_sslmode: DatabaseSslMode | None = None
    """libpq's ``sslmode``: ``disable``, ``prefer``, ``require``, ``verify-ca`` or
    ``verify-full`` (production). Unset: the URL's ``sslmode``, else asyncpg's
    default (``prefer``)."""

    database_ssl_root_cert_file: Path | None = None
    """CA bundle the server's certificate must chain to (``verify-ca`` and
    ``verify-full``); unset: the system's trust store."""

    database_pool_min: int = Field(default=1, ge=0, le=100)
    """Connections the pool keeps open when idle."""

    database_pool_max: int = Field(default=20, ge=1, le=500)
    """Most connections the pool opens. An activation borrows one per statement or
    transaction only, never across a call to admission or the pod create, so this
    bounds concurrent statements, not activations in progress."""

    database_statement_cache_size: int = Field(default=100, ge=0, le=10_000)
    """Prepared statements asyncpg keeps per connection (named, server-side). Set 0
    behind PgBouncer in transaction mode older than 1.21 or without
    ``max_prepared_statements``: a named statement lives on one server session, and
    such a PgBouncer hands the next transaction to any session. With 0 asyncpg uses
    unnamed statements, which work there (tested)."""

    database_timeout_s: float = Field(default=5.0, gt=0, le=120)
    """Budget of one database statement, and of waiting for a pool connection (connect
    included); a statement that spends it closes its connection."""

    admission_wait_margin_s: float = Field(default=10.0, ge=0, le=600)
    """What an Activate that asks to wait (``wait_budget``) keeps back from its
    deadline for the create: admission's fair queue may keep it until then."""

    activation_lock_timeout_s: float = Field(default=30.0, gt=0, le=600)
    """How long an Activate or Deactivate waits for another one of the same sandbox
    (on any replica) to finish before answering (``UNAVAILABLE``, or ``ABORTED`` for
    an Activate that joined one here: SPEC N2), and never past the call's deadline."""

    activation_waiters_per_flow: int = Field(default=8, ge=0, le=1024)
    """How many calls of one flow (the caller's identity and the client it acts for)
    may wait on another call's work on this replica's sandboxes at a time: Activates
    joining an activation in progress, and calls waiting for a sandbox's lock. The
    next is refused at once (``ABORTED``, ``SANDBOX_PENDING``, retry hint), so a
    flood of one sandbox holds at most this many of the replica's call slots (SPEC
    N2). 0: no call waits; every concurrent Activate of a sandbox is refused."""

    activation_claim_ttl_s: float = Field(default=10.0, ge=0.2, le=600)
    """How long an activation's claim on its sandbox lasts unless renewed (every third
    of this while the activation runs). A replica that dies mid-activation blocks
    that sandbox's next activation this long at most; then its claim is taken over."""

    activation_claim_max_s: float = Field(default=120.0, gt=0, le=3600)
    """An activation still running after this stops renewing its claim, so a stuck one
    cannot hold its sandbox for ever: one TTL later another activation may take the
    sandbox over, and the stuck one's final write is then refused (fencing)."""

    retry_after_s: float = Field(default=1.0, gt=0, le=300)
    """The retry hint of a retryable error when nothing better is known (a
    dependency failed, or admission gave no hint)."""

    live_counts_ttl_s: float = Field(default=5.0, gt=0, le=300)
    """TTL of the ``live-state`` marker that tells admission the live counts in Redis
    are current (or, on Direct, that this substrate cannot count). The leader renews
    it every third of this; a leader that dies or falls behind lets it lapse, and
    until a leader has resynced the cap decides on the pending set alone."""

    live_counts_chunk: int = Field(default=500, ge=1, le=100_000)
    """Sandbox ids per script when the leader resyncs the live counts, and per page
    when it reads what is published: bounds how long one script holds Redis."""

    direct_runtime_command: str = "turnstile-worker"
    """Direct substrate: the command (shell-style words, no shell) each sandbox's
    runtime runs. It receives ``TURNSTILE_WORKER_SANDBOX_ID``,
    ``TURNSTILE_WORKER_TIER``, ``TURNSTILE_AFFINITY_ADDR`` and, when set,
    ``TURNSTILE_WORKER_CAPACITY`` and ``TURNSTILE_WORKER_CREDENTIAL_FILE``, and must
    exit on SIGTERM."""

    direct_runtime_preload: str = Field(
        default="", pattern=r"^([A-Za-z_][A-Za-z0-9_.]*:[A-Za-z_][A-Za-z0-9_]*)?$"
    )
    """Direct substrate: ``module:function`` of a Python runtime to preload. Set: a
    launcher process imports the module once, at start, and each runtime is forked
    from it and calls the function (milliseconds instead of the interpreter's start
    and imports, which a woken session waits for); the runtime gets the same
    environment, working directory, log and process group as one started from
    ``direct_runtime_command``, which is still used whenever the launcher is
    unavailable. ``turnstilectl up`` sets ``turnstile_affinity.worker.__main__:main``
    (the worker agent). Empty: every runtime starts from the command."""

    direct_runtime_env_allow: str = Field(default="", pattern=r"^[A-Za-z0-9_, ]*$")
    """Direct substrate: comma-separated names of more variables of this process's
    environment to pass to runtimes, beyond the allowlist (``PATH``, ``LANG``,
    ``LANGUAGE``, ``LC_*``, ``TZ``, ``TERM``, ``TURNSTILE_LOG_LEVEL``,
    ``TURNSTILE_LOG_FORMAT``; ``HOME`` is the runtime's workspace). Exact names, no
    patterns, none by default: a runtime runs untrusted code, so never name a secret
    (SPEC O4, docs/security.md)."""

    direct_runtime_uids: str = Field(default="", pattern=r"^(\d+-\d+)?$")
    """Direct substrate: ``first-last``, a range of uids to run runtimes as, one per
    running runtime (no ``/etc/passwd`` entries needed), all in the group numbered
    ``first``. The substrate must run as root. Runtimes then cannot read the
    substrate's keys, its environment, nor each other's credential and workspace
    (SPEC O4). Set this or ``direct_runtime_user`` when running as root."""

    direct_runtime_user: str = Field(default="", max_length=64)
    """Direct substrate: a user (name or uid) every runtime runs as, e.g.
    ``turnstile-runtime`` or ``nobody``: runtimes cannot read the substrate's keys or
    environment, but can read each other's files (prefer ``direct_runtime_uids``).
    The substrate's own user (or unset on a non-root substrate) runs runtimes as
    itself: only the environment is then isolated. A root substrate with neither
    setting refuses to start."""

    direct_state_dir: Path = Path(".run/direct")
    """Direct substrate: one directory per sandbox holds its workspace (the
    runtime's working directory, kept across stop and restore), its runtime
    record (pid and start time, so a restarted substrate finds the runtimes that
    outlived it) and its log."""

    direct_stop_grace_s: float = Field(default=5.0, ge=0, le=300)
    """Direct substrate: after SIGTERM, how long a runtime's process group may take
    to exit before it is killed with SIGKILL."""

    direct_live_counts: Literal["count", "unsupported"] = "unsupported"
    """Direct substrate (SPEC S4): ``count`` publishes its live runtimes by bounded
    key, as the Kubernetes leader publishes its reflector's, so the cap applies
    (``turnstilectl up`` sets it); ``unsupported`` declares that it does not count,
    so the cap answers unknown (unsupported) and admits."""

    worker_credential_signing_key_file: Path | None = None
    """PEM (PKCS#8) Ed25519 private key sandbox credentials are signed with (SPEC Z3).
    Set: every runtime started gets a credential bound to its sandbox, renewed while
    it runs and revoked when it stops (this needs Redis, also on Direct). Unset: no
    credentials, and workers can attach only to a relay with attestation off."""

    worker_credential_ttl_s: float = Field(default=3600.0, ge=60, le=7 * 86_400)
    """How long a sandbox credential is valid; it is renewed once less than half of
    this remains, and a revocation record lives this long."""

    worker_credential_renew_interval_s: float = Field(default=300.0, gt=0, le=86_400)
    """How often the renewal pass looks for credentials past half their ttl. Keep it
    well under half the ttl."""

    direct_worker_capacity: int | None = Field(default=None, ge=1, le=10_000)
    """Direct substrate: ``TURNSTILE_WORKER_CAPACITY`` given to each runtime (turns
    it serves at once); unset leaves the worker's own default."""

    direct_worker_tls_cert_file: Path | None = None
    """Direct substrate: the sandbox-class certificate given to each runtime (as
    ``TURNSTILE_WORKER_TLS_CERT_FILE``, with this process's CA bundle as
    ``TURNSTILE_WORKER_TLS_CA_FILE``); it proves only "a sandbox runtime" and the
    policy lets it call ``Attach`` alone. Required with mTLS on the Direct substrate;
    in plaintext mode runtimes get ``TURNSTILE_WORKER_PLAINTEXT`` instead."""

    direct_worker_tls_key_file: Path | None = None
    """Direct substrate: the private key of ``direct_worker_tls_cert_file``."""
