"""Certificates for tests: a CA of the test's own, SPIFFE identities, policy files.

The shared service fixtures run in explicit loopback plaintext (the plugin sets
``TURNSTILE_PLAINTEXT=true`` for the test process), so the many tests about
admission, placement and runtimes need no certificates. Tests about transport
security and authorization ask for :func:`pki` and pass
:meth:`Pki.server_settings` as overrides to the same fixtures, which turns
mTLS and the policy on for that server.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from turnstile_platform.pki import CertificateAuthority, Leaf

TRUST_DOMAIN = "turnstile.test"

PERMISSIVE_POLICY = """
[[allow]]
identities = ["*"]
methods = ["*"]
clients = "any"
"""


@dataclass(frozen=True)
class Identity:
    spiffe_id: str | None
    cert_file: Path
    key_file: Path
    ca_file: Path

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(
            root_certificates=self.ca_file.read_bytes(),
            private_key=self.key_file.read_bytes(),
            certificate_chain=self.cert_file.read_bytes(),
        )

    def channel(self, target: str) -> grpc.aio.Channel:
        return grpc.aio.secure_channel(target, self.credentials())

    def settings(self) -> dict[str, Any]:
        """Settings overrides that make a process present this identity."""
        return {
            "plaintext": False,
            "tls_cert_file": self.cert_file,
            "tls_key_file": self.key_file,
            "tls_ca_file": self.ca_file,
        }


@dataclass
class Pki:
    directory: Path
    ca: CertificateAuthority = field(default_factory=CertificateAuthority.create)
    trust_domain: str = TRUST_DOMAIN
    _count: int = 0

    def __post_init__(self) -> None:
        self.directory.mkdir(parents=True, exist_ok=True)
        self.ca_file = self.directory / "ca.crt"
        self.ca_file.write_bytes(self.ca.cert_pem)

    def spiffe(self, path: str) -> str:
        return f"spiffe://{self.trust_domain}/{path.lstrip('/')}"

    def leaf(self, path: str | None, *, server: bool = False, **kwargs: Any) -> Leaf:
        """A certificate as the local PKI issues it (SPEC O5): a client one
        (``clientAuth``, no names) unless ``server`` (``serverAuth`` too, its server
        name and the loopback names)."""
        spiffe_id = self.spiffe(path) if path is not None else None
        if server:
            kwargs.setdefault("dns_names", ["localhost"])
            kwargs.setdefault("ip_addresses", ["127.0.0.1", "::1"])
        return self.ca.issue(spiffe_id, server=server, **kwargs)

    def identity(
        self, path: str | None, *, name: str | None = None, server: bool = False, **kwargs: Any
    ) -> Identity:
        """Files for ``spiffe://turnstile.test/<path>`` (``None``: a certificate
        from this CA with no SPIFFE ID); ``server``: a server certificate."""
        self._count += 1
        stem = name or f"id{self._count}"
        cert_file, key_file = self.directory / f"{stem}.crt", self.directory / f"{stem}.key"
        self.leaf(path, server=server, **kwargs).write(cert_file, key_file)
        return Identity(self.spiffe(path) if path else None, cert_file, key_file, self.ca_file)

    def peer_ids(self) -> dict[str, str]:
        """Settings overrides naming the services of this trust domain as the
        identities a process's peer channels expect (``service/admission`` …)."""
        return {
            f"{service}_spiffe_id": self.spiffe(f"service/{service}")
            for service in ("admission", "substrate", "affinity")
        }

    def policy(self, text: str = PERMISSIVE_POLICY, *, name: str = "policy.toml") -> Path:
        path = self.directory / name
        tmp = path.with_suffix(".tmp")
        tmp.write_text(text)
        tmp.replace(path)
        return path

    def server_settings(
        self, path: str = "service/test", *, policy: str = PERMISSIVE_POLICY, **extra: Any
    ) -> dict[str, Any]:
        """Overrides for a service fixture: mTLS with a server identity and a policy,
        its peer channels expecting this trust domain's services."""
        server = self.identity(path, server=True)
        return {
            **self.peer_ids(),
            **server.settings(),
            "authz_policy_file": self.policy(policy),
            "authz_poll_interval_s": 0.05,
            **extra,
        }
