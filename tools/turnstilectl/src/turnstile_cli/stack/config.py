"""What the local stack runs: three services, their ports, and their environment.

Every setting a service reads is passed as its ``TURNSTILE_*`` variable; the
user's own environment comes first, so anything not set here (a policy mode,
``OTEL_EXPORTER_OTLP_ENDPOINT``) reaches the services unchanged.
"""

from __future__ import annotations

import os
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path

from turnstile_cli.stack.defaults import LOCAL_GRACE_S, LOCAL_TIERS

#: The local stack's SPIFFE trust domain (the Kubernetes manifests use the same).
TRUST_DOMAIN = "turnstile.local"

#: Who gets a certificate under the TLS directory, and its SPIFFE path.
HOLDERS = {
    "admission": "service/admission",
    "substrate": "service/substrate",
    "affinity": "service/affinity",
    "cli": "operator/turnstilectl",
    "worker": "sandbox",
}

#: The holders that serve (server certificates: serverAuth and their server name);
#: the CLI and the sandbox class get client-only certificates (SPEC O5).
SERVERS = frozenset({"admission", "substrate", "affinity"})


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    command: str
    port: int
    metrics_port: int
    env: dict[str, str] = field(default_factory=dict)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass(frozen=True)
class StackConfig:
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_prefix: str = "turnstile:"
    database_url: str = "postgresql://postgres@127.0.0.1:5432/turnstile"
    ports: tuple[int, int, int] = (50051, 50052, 50053)
    metrics_ports: tuple[int, int, int] = (9091, 9092, 9093)
    tiers: str = LOCAL_TIERS
    default_tier: str = ""
    grace_s: float = LOCAL_GRACE_S
    state_dir: Path = Path(".run/direct")
    log_level: str = "INFO"
    extra_env: dict[str, str] = field(default_factory=dict)
    #: Where a local Prometheus listens when one is installed (0: none).
    prometheus_port: int = 9090
    #: Which ports were not given (``grpc``, ``metrics``, ``prometheus``): those
    #: taken at start (another checkout's stack) move to free ones.
    pick_free: frozenset[str] = frozenset()
    prometheus_scrape_s: float = 5.0
    tls_dir: Path | None = Path(".run/tls")
    """Where the local CA, certificates and policy live; None runs plaintext."""

    @property
    def credentials_dir(self) -> Path:
        """The sandbox-credential key pair (SPEC Z3), beside the state directory:
        generated on first start, kept across restarts so running workers' credentials
        stay valid."""
        return self.state_dir.absolute().parent / "sandbox-credentials"

    @property
    def signing_key_file(self) -> Path:
        return self.credentials_dir / "signing-key.pem"

    @property
    def public_keys_file(self) -> Path:
        return self.credentials_dir / "public-keys.pem"

    def tls_file(self, name: str) -> str:
        assert self.tls_dir is not None
        return str((self.tls_dir / name).absolute())

    def transport_env(self, service: str) -> dict[str, str]:
        """mTLS files of one service (or plaintext when there is no TLS directory)."""
        if self.tls_dir is None:
            return {"TURNSTILE_PLAINTEXT": "true"}
        env = {
            "TURNSTILE_PLAINTEXT": "false",
            "TURNSTILE_TLS_CERT_FILE": self.tls_file(f"{service}.crt"),
            "TURNSTILE_TLS_KEY_FILE": self.tls_file(f"{service}.key"),
            "TURNSTILE_TLS_CA_FILE": self.tls_file("ca.crt"),
            "TURNSTILE_AUTHZ_POLICY_FILE": self.tls_file("policy.toml"),
        }
        if service == "substrate":
            env["TURNSTILE_DIRECT_WORKER_TLS_CERT_FILE"] = self.tls_file("worker.crt")
            env["TURNSTILE_DIRECT_WORKER_TLS_KEY_FILE"] = self.tls_file("worker.key")
        return env

    @property
    def addresses(self) -> tuple[str, str, str]:
        a, s, f = self.ports
        return f"127.0.0.1:{a}", f"127.0.0.1:{s}", f"127.0.0.1:{f}"

    def common_env(self) -> dict[str, str]:
        admission, substrate, affinity = self.addresses
        return {
            "TURNSTILE_HOST": "127.0.0.1",
            "TURNSTILE_REDIS_URL": self.redis_url,
            "TURNSTILE_REDIS_PREFIX": self.redis_prefix,
            "TURNSTILE_ADMISSION_ADDR": admission,
            "TURNSTILE_SUBSTRATE_ADDR": substrate,
            "TURNSTILE_AFFINITY_ADDR": affinity,
            "TURNSTILE_TIERS": self.tiers,
            "TURNSTILE_DEFAULT_TIER": self.default_tier,
            "TURNSTILE_LOG_FORMAT": "text",
            "TURNSTILE_LOG_LEVEL": self.log_level,
            # Find the workspace's commands (services, the worker agent) first.
            "PATH": os.pathsep.join([str(bin_dir()), os.environ.get("PATH", "")]),
            "PYTHONUNBUFFERED": "1",
        }

    def services(self) -> list[ServiceSpec]:
        (a, s, f), (ma, ms, mf) = self.ports, self.metrics_ports
        return [
            ServiceSpec("admission", "turnstile-admission", a, ma),
            ServiceSpec(
                "substrate",
                "turnstile-substrate",
                s,
                ms,
                {
                    "TURNSTILE_SUBSTRATE_KIND": "direct",
                    "TURNSTILE_DATABASE_URL": self.database_url,
                    "TURNSTILE_DIRECT_STATE_DIR": str(self.state_dir.absolute()),
                    # The cap applies locally: the substrate counts its runtimes (S4).
                    "TURNSTILE_DIRECT_LIVE_COUNTS": os.environ.get(
                        "TURNSTILE_DIRECT_LIVE_COUNTS", "count"
                    ),
                    # Woken sandboxes' workers are forked pre-imported (fast wakes);
                    # an explicit setting, even empty, wins.
                    "TURNSTILE_DIRECT_RUNTIME_PRELOAD": os.environ.get(
                        "TURNSTILE_DIRECT_RUNTIME_PRELOAD", WORKER_PRELOAD
                    ),
                    "TURNSTILE_WORKER_CREDENTIAL_SIGNING_KEY_FILE": str(self.signing_key_file),
                },
            ),
            ServiceSpec(
                "affinity",
                "turnstile-affinity",
                f,
                mf,
                {
                    "TURNSTILE_GRACE_S": f"{self.grace_s:g}",
                    "TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE": str(self.public_keys_file),
                },
            ),
        ]

    def environment(self, spec: ServiceSpec) -> dict[str, str]:
        return {
            **os.environ,
            **self.common_env(),
            "TURNSTILE_PORT": str(spec.port),
            "TURNSTILE_METRICS_PORT": str(spec.metrics_port),
            **self.transport_env(spec.name),
            **spec.env,
            **self.extra_env,
        }


#: The worker agent's entry point, preloaded by the Direct substrate (fast wakes).
WORKER_PRELOAD = "turnstile_affinity.worker.__main__:main"


def checkout_id(state_dir: Path) -> str:
    """8 hex digits of the path of the checkout whose stack keeps its state in
    ``state_dir`` (the checkout being the directory holding ``.run/``): what tells
    two checkouts' local stacks apart on one machine. Stable across restarts."""
    import hashlib

    checkout = state_dir.absolute().parent.parent
    return hashlib.sha256(str(checkout).encode()).hexdigest()[:8]


def checkout_prefix(state_dir: Path) -> str:
    """The Redis prefix of the local stack whose state lives in ``state_dir``:
    ``turnstile:<checkout id>:`` (two checkouts sharing one Redis would otherwise
    share one key set, limits and live counts)."""
    return f"turnstile:{checkout_id(state_dir)}:"


#: The local PostgreSQL server the stack's database is created on by default.
LOCAL_POSTGRES = "postgresql://postgres@127.0.0.1:5432"


def checkout_database_url(state_dir: Path) -> str:
    """The database of the local stack whose state lives in ``state_dir``:
    ``turnstile_<checkout id>`` on the local server, created at start when
    missing, so two checkouts never share sandbox records."""
    return f"{LOCAL_POSTGRES}/turnstile_{checkout_id(state_dir)}"


def bin_dir() -> Path:
    """The directory of this interpreter's console scripts (the uv workspace's)."""
    return Path(sys.executable).parent


def find_command(name: str) -> str | None:
    local = bin_dir() / name
    if local.exists():
        return str(local)
    return shutil.which(name)


__all__ = [
    "HOLDERS",
    "LOCAL_GRACE_S",
    "LOCAL_TIERS",
    "SERVERS",
    "TRUST_DOMAIN",
    "ServiceSpec",
    "StackConfig",
    "bin_dir",
    "checkout_database_url",
    "checkout_id",
    "checkout_prefix",
    "find_command",
]
