"""Settings shared by every Turnstile process, read from ``TURNSTILE_*`` variables.

Each service subclasses :class:`ServiceSettings` and adds its own fields; every
default lives on the field that owns it, with a docstring saying what it is for.
Invalid values fail start-up with pydantic's message naming the variable, but
never echoing the value: a URL may carry a password (SPEC Z4). URLs are left out
of the settings' ``repr`` too; :func:`redact_url` is what logs may print.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, UrlConstraints
from pydantic_core import MultiHostUrl
from pydantic_settings import BaseSettings, SettingsConfigDict

from turnstile_platform.identity import server_name
from turnstile_platform.redis_topology import SCHEMES, parse_redis_url


def _redis_topology(url: MultiHostUrl) -> MultiHostUrl:
    parse_redis_url(str(url))  # a sentinel URL names its service, a cluster URL has no db …
    return url


#: One server (``redis://``, ``rediss://``, ``unix://``), a Sentinel-managed primary
#: (``redis+sentinel://s1:26379,s2:26379/<service>/<db>``) or a Cluster
#: (``redis+cluster://n1:6379,n2:6379``): see :mod:`turnstile_platform.redis_topology`.
RedisUrl = Annotated[
    MultiHostUrl, UrlConstraints(allowed_schemes=list(SCHEMES)), AfterValidator(_redis_topology)
]
#: One host or several (``postgresql://u@h1:5432,h2:5432/db?target_session_attrs=read-write``):
#: asyncpg tries the hosts in order and keeps the first that matches the attributes.
PostgresUrl = Annotated[
    MultiHostUrl, UrlConstraints(allowed_schemes=["postgres", "postgresql"], host_required=True)
]

LogFormat = Literal["json", "text"]


def _server_spiffe_id(value: str) -> str:
    server_name(value)  # a SPIFFE ID whose path segments are DNS labels, or ValueError
    return value


#: The SPIFFE ID a peer service's certificate must hold (SPEC O5): one whose
#: derived server name (:func:`turnstile_platform.identity.server_name`) exists.
ServerSpiffeId = Annotated[str, AfterValidator(_server_spiffe_id)]


class SettingsError(ValueError):
    """Settings a service cannot start with (a value, or two that contradict each
    other, or one the process's own user rules out); the message names the setting
    and says what to set. :func:`~turnstile_platform.runner.run_service` turns it
    into one log line and exit status 2, like a missing certificate."""


class DecisionLogSettings(BaseModel):
    """The decision log's bounds (SPEC Q3, N3), the same in every service that writes
    it (``TURNSTILE_DECISION_LOG__*``; :mod:`turnstile_platform.decision_log`). Each
    bounded key's stream, and the platform's, is bounded on its own: a client's
    flood trims only its own history."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True, extra="forbid")

    max_entries: int = Field(default=20_000, ge=0, le=10_000_000)
    """Entries kept at most per stream: per bounded key, and the platform's
    (trimmed approximately: within one stream node, 100 entries by default); 0
    turns the log off. Redis memory is about 460 bytes an entry per stream."""

    max_age_s: float = Field(default=7 * 86400.0, gt=0, le=90 * 86400.0)
    """Entries older than this are trimmed (approximately, as above); a stream
    expires this long after its last entry."""

    sandbox_max_entries: int = Field(default=100, ge=0, le=10_000)
    """Entries kept per sandbox in its key's sandbox stream, which serves a read
    filtered by sandbox without scanning the key's other entries; 0: no sandbox
    streams (such reads scan the key's stream, within the read's scan bound)."""

    max_sandboxes: int = Field(default=1_000, ge=1, le=100_000)
    """Sandbox streams kept per bounded key; past it the least recently logged
    sandbox's stream is deleted (its entries stay in the key's stream)."""

    read_legacy: bool = True
    """Reads also merge the single stream the log was before SPEC N3
    (``<prefix>{adm}:decisions``), filtered and scan-bounded as it was, while an
    upgrade's old entries age out; it expires on its own ``max_age_s`` after its
    last write. Turn off once it is gone."""


#: The levels a role may name (:class:`turnstile_platform.fair_share.Level`).
LevelName = Literal["platform", "tenants", "placements", "workers"]


def _default_roles() -> dict[str, LevelName]:
    return {"/service/gateway": "placements", "/sandbox": "workers"}


def _role_patterns(roles: dict[str, LevelName]) -> dict[str, LevelName]:
    for pattern in roles:
        bare = pattern.removesuffix("/*")
        if not pattern.startswith("/") or "*" in bare or len(pattern) > 256:
            raise ValueError(
                f"role pattern {pattern!r}: a SPIFFE ID path such as '/service/gateway', "
                "or a prefix such as '/client/*'"
            )
    return roles


class FairShareSettings(BaseModel):
    """How a replica shares its call seats among priority levels and flows (SPEC N1;
    ``TURNSTILE_FAIR_SHARE__*``; :mod:`turnstile_platform.fair_share`). Each level is
    assured ``ceil(total × its shares ÷ all shares)`` of ``max_concurrent_rpcs`` (and
    of ``max_concurrent_streams``) and may borrow what other levels leave idle."""

    model_config = ConfigDict(frozen=True, use_attribute_docstrings=True, extra="forbid")

    platform_shares: int = Field(default=30, ge=1, le=1000)
    """Shares of the platform level: calls of identities the policy allows every
    client (the services, operators), and loopback plaintext's one anonymous flow."""

    tenant_shares: int = Field(default=40, ge=1, le=1000)
    """Shares of the tenants level: calls of identities the policy scopes to their
    own clients (``self`` or a list)."""

    placement_shares: int = Field(default=20, ge=1, le=1000)
    """Shares of the placements level: the gateway's calls (``roles``)."""

    worker_shares: int = Field(default=10, ge=1, le=1000)
    """Shares of the workers level: the sandboxes' relay streams (``roles``)."""

    queue_length: int = Field(default=8, ge=0, le=1000)
    """Calls of one flow that may wait for a seat at once, past its fair share; one
    more is refused at once (0: none waits)."""

    queue_wait_s: float = Field(default=1.0, ge=0, le=60)
    """How long a call waits in its flow's queue for a seat before it is refused
    (0: none waits). Keep it well below callers' deadlines."""

    roles: Annotated[dict[str, LevelName], AfterValidator(_role_patterns)] = Field(
        default_factory=_default_roles,
        max_length=64,
    )
    """Identities whose level is not the one their policy grant implies: a SPIFFE ID
    path (any trust domain) or a path prefix ending ``/*``, to a level (a JSON
    object). The longest matching pattern wins. Unlisted identities are
    ``platform`` when the policy allows them every client for the method,
    ``tenants`` otherwise."""


class ServiceSettings(BaseSettings):
    """What every service process needs: where it listens, Redis, peers, limits."""

    model_config = SettingsConfigDict(
        env_prefix="TURNSTILE_",
        extra="ignore",
        frozen=True,
        validate_default=True,
        hide_input_in_errors=True,
    )

    host: str = "127.0.0.1"
    """Address the gRPC server binds; ``0.0.0.0`` in containers."""

    port: int = Field(default=0, ge=0, le=65535)
    """gRPC port; each service sets its own default (0 picks a free port)."""

    metrics_port: int = Field(default=0, ge=0, le=65535)
    """Prometheus ``/metrics`` port; 0 disables the endpoint."""

    redis_url: RedisUrl = Field(default=MultiHostUrl("redis://127.0.0.1:6379/0"), repr=False)
    """Redis holding admission, key-set and affinity state. ``rediss://`` for TLS;
    an ACL user as ``rediss://user@host:6380/0`` with the password from
    ``redis_password_file`` (a password in the URL works but belongs in a Secret).
    A Sentinel-managed primary as ``redis+sentinel://s1:26379,s2:26379/<service>/<db>``,
    a Cluster as ``redis+cluster://n1:6379,n2:6379`` (``rediss+…`` for TLS)."""

    redis_username: str | None = None
    """Redis ACL user (overrides the URL's); pair it with ``redis_password_file``."""

    redis_password_file: Path | None = None
    """A file holding the Redis password (a mounted Secret); read at start."""

    redis_sentinel_password_file: Path | None = None
    """A file holding the sentinels' own password, when they require one (unset:
    the sentinels are asked without a password; the Redis servers' password is
    ``redis_password_file``)."""

    redis_ca_file: Path | None = None
    """CA bundle that a ``rediss://`` server's certificate must chain to (unset:
    the system's trust store)."""

    redis_prefix: str = Field(
        default="turnstile:", min_length=1, max_length=64, pattern=r"^[^{}]+$"
    )
    """Prefix of every Redis key this deployment writes; tests give each run its own.
    No braces: the hash tags after it (``{adm}``, ``{affinity}``) must be the first
    ``{...}`` in each key, or a Redis Cluster would place keys by the prefix."""

    decision_log: DecisionLogSettings = DecisionLogSettings()
    """The decision log (SPEC Q3): admission appends its decisions, the substrate
    and affinity their side of the same calls."""

    redis_timeout_s: float = Field(default=0.5, gt=0, le=30)
    """Budget of one Redis call, covering pool waits, reconnects, retries and
    health checks: a decision never waits longer on a Redis that does not
    answer. A call held up by this process's own overload while Redis answers
    others waits on (see ``overload_wait_s``) instead of applying a fail mode."""

    redis_max_connections: int = Field(default=256, ge=1, le=100_000)
    """Connections of the Redis pool (per node on a Cluster). A call that finds all
    in use waits its turn inside its budget; one held up past ``overload_wait_s``
    by that queue is this replica's overload, shed, never a fail mode."""

    breaker_failures: int = Field(default=3, ge=1, le=1000)
    """Consecutive failed calls (budget spent, connection refused or dropped) to a
    dependency (Redis, PostgreSQL) that open its circuit breaker; while it is
    open, calls fail at once and each policy applies its fail mode."""

    overload_wait_s: float = Field(default=10.0, gt=0, le=300)
    """How long a Redis or PostgreSQL call held up by this process's own overload
    (its budget spent while the dependency answered other calls, or the event
    loop stalled) may go on waiting for its answer, from its start, before it
    fails as overloaded: a retryable ``UNAVAILABLE`` (``REPLICA_OVERLOADED``),
    never a fail mode. An RPC's own deadline ends the wait sooner."""

    retry_after_s: float = Field(default=1.0, gt=0, le=3600)
    """The retry hint (``RetryInfo``) of a call refused because a dependency failed:
    unavailable, or this replica overloaded (answered by the platform interceptor)."""

    breaker_open_s: float = Field(default=1.0, gt=0, le=300)
    """How long an open breaker refuses calls before letting one probe through;
    the probe's success closes it, its failure opens it again."""

    health_check_interval_s: float = Field(default=1.0, gt=0, le=60)
    """How often each health component (Redis, PostgreSQL, the substrate) is
    checked; the check of a dependency also probes its breaker."""

    admission_addr: str = "127.0.0.1:50051"
    """Where the admission service listens (host:port or a gRPC target)."""

    substrate_addr: str = "127.0.0.1:50052"
    """Where the substrate service listens."""

    affinity_addr: str = "127.0.0.1:50053"
    """Where the affinity service listens."""

    admission_spiffe_id: ServerSpiffeId = "spiffe://turnstile.local/service/admission"
    """The SPIFFE ID the admission service's certificate must hold: a channel to it
    refuses any other server (it checks the DNS name derived from the ID,
    ``admission.service.turnstile.local``; SPEC O5, docs/security.md)."""

    substrate_spiffe_id: ServerSpiffeId = "spiffe://turnstile.local/service/substrate"
    """The SPIFFE ID the substrate service's certificate must hold."""

    affinity_spiffe_id: ServerSpiffeId = "spiffe://turnstile.local/service/affinity"
    """The SPIFFE ID the affinity service's certificate must hold."""

    rpc_timeout_s: float = Field(default=2.0, gt=0, le=120)
    """Default deadline of a call to another Turnstile service."""

    max_message_bytes: int = Field(default=4 * 1024 * 1024, ge=64 * 1024, le=64 * 1024 * 1024)
    """Largest gRPC message received or sent."""

    max_concurrent_rpcs: int = Field(default=1024, ge=1, le=100_000)
    """Unary RPCs served at once: the total the priority levels share
    (``fair_share``); a flow past its share waits briefly or is refused with
    RESOURCE_EXHAUSTED (``CONCURRENCY_LIMITED``, with a retry hint). Streams have
    their own limit."""

    max_concurrent_streams: int = Field(default=1024, ge=1, le=100_000)
    """Streaming RPCs (the relay's worker ``Attach``) served at once, counted apart
    from unary ones so long-lived streams never take the slots ``Place`` needs;
    shared by the levels like the unary total (``fair_share``)."""

    fair_share: FairShareSettings = FairShareSettings()
    """How those calls and streams are shared among priority levels and flows
    (SPEC N1): a flow past its fair share waits briefly in its own queue or is
    refused, never another flow's call."""

    keepalive_time_s: float = Field(default=60.0, ge=1, le=7200)
    """How often the server pings a connection that is otherwise quiet, so a dead
    peer (or a middlebox that dropped the connection) is noticed."""

    keepalive_timeout_s: float = Field(default=20.0, ge=1, le=600)
    """How long the server waits for a ping's answer before closing the connection."""

    keepalive_min_ping_interval_s: float = Field(default=10.0, ge=1, le=3600)
    """The shortest interval between a client's pings the server tolerates (with or
    without calls); clients pinging more often are disconnected. Keep it below every
    client's keepalive time (the worker agent's is 30 s)."""

    max_connection_age_s: float = Field(default=0.0, ge=0, le=7 * 86_400)
    """After about this long (gRPC adds ±10% jitter) the server sends a connection
    GOAWAY, so its client's next call opens a new connection, possibly to another
    replica; 0 keeps connections forever. The affinity relay sets it so workers
    spread over replicas after a rollout."""

    max_connection_age_grace_s: float = Field(default=0.0, ge=0, le=7 * 86_400)
    """How long calls still running on a connection past its maximum age may go on
    before the server closes it; 0 means without limit."""

    call_accept_wait_s: int = Field(default=300, ge=1, le=86_400)
    """How long a call that reached the server may wait for this process to take it
    up (its event loop too busy to start its handler) before gRPC drops it. gRPC's
    own limit is 30 s, and it answers such a call CANCELLED, which tells the caller
    nothing (an overloaded replica's Admits were answered so). The default outlasts
    every caller's deadline (``rpc_timeout_s`` is at most 120 s), so the call either
    gets its turn and its answer, or its caller's deadline ends it
    (DEADLINE_EXCEEDED); it bounds only calls without one."""

    loop_lag_interval_s: float = Field(default=0.25, ge=0.01, le=10)
    """How often the event-loop lag monitor asks to run; how late each beat runs is
    ``turnstile_event_loop_lag_seconds`` (a stalled or CPU-starved loop, which every
    call waits for too). Shorter catches briefer stalls and costs a wake-up each."""

    shutdown_drain_delay_s: float = Field(default=0.0, ge=0, le=60)
    """After SIGTERM, how long health reports NOT_SERVING before the server stops
    accepting calls, so load balancers and kube-proxy stop routing to it. Set to a
    few seconds on Kubernetes; 0 locally."""

    shutdown_grace_s: float = Field(default=10.0, ge=0, le=300)
    """How long in-flight calls may run after the server stops accepting."""

    client_allowlist: tuple[str, ...] = ()
    """Client ids with a bucket of their own, seeding the key set when Redis has
    none (a JSON list, e.g. ``["acme","globex"]``). After that the key set in Redis
    is the source of truth: change it with ``turnstilectl keys``."""

    keyset_poll_interval_s: float = Field(default=0.5, gt=0, le=10)
    """How often each replica checks the key-set version, the safety net behind
    pub/sub; a change reaches every replica within about this long."""

    plaintext: bool = False
    """Serve and call without TLS. Only for development, and only when the listen
    address is loopback: the process refuses to start otherwise (SPEC Z5). Callers
    then have no identity and authorization is off."""

    tls_cert_file: Path | None = None
    """This process's certificate chain (PEM; its one URI SAN is its SPIFFE ID),
    presented as server and as client. Re-read when it changes."""

    tls_key_file: Path | None = None
    """The private key of ``tls_cert_file`` (PEM)."""

    tls_ca_file: Path | None = None
    """The CA bundle (PEM) that peers' certificates must chain to."""

    health_port: int = Field(default=0, ge=0, le=65535)
    """A second, plaintext port serving only ``grpc.health.v1`` (kubelet gRPC probes
    carry no client certificate); 0 disables it. Health tells nothing a probe
    should not know."""

    authz_policy_file: Path | None = None
    """The authorization policy (TOML, see docs/security.md); required with mTLS.
    Reloaded when it changes; an invalid file keeps the last good policy."""

    authz_poll_interval_s: float = Field(default=0.5, gt=0, le=60)
    """How often each replica checks the policy file for a change."""

    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    """Root log level."""

    log_format: LogFormat = "json"
    """``json`` (one object per line, with trace ids) or ``text`` for terminals."""


def redact_url(url: object) -> str:
    """``url`` with any password replaced by ``***`` (for logs and messages)."""
    text = str(url)
    scheme, sep, rest = text.partition("://")
    if not sep:
        return text
    netloc, slash, tail = rest.partition("/")
    userinfo, at, host = netloc.rpartition("@")
    if not at or ":" not in userinfo:
        return text
    user = userinfo.split(":", 1)[0]
    return f"{scheme}://{user}:***@{host}{slash}{tail}"


def read_secret(path: Path | None) -> str | None:
    """The stripped contents of a secret file, or None when no file is set."""
    if path is None:
        return None
    return path.read_text(encoding="utf-8").strip()
