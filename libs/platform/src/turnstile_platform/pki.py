"""A small certificate authority for the local stack and the tests (SPEC Z4).

Production certificates come from cert-manager (or SPIRE); this module issues the
same shape locally, with ``cryptography``: a self-signed CA and leaf
certificates whose one URI SAN is the holder's SPIFFE ID (``spiffe://<trust
domain>/<path>``). Each role gets only the usages and names it needs (SPEC O5):
a service is ``serverAuth`` + ``clientAuth`` and carries the DNS name its
clients check (:func:`turnstile_platform.identity.server_name` of its SPIFFE
ID) plus the loopback names it listens on; every other holder (the CLI, tenants,
the sandbox class) is ``clientAuth`` only, with no DNS or IP name, so it cannot
serve TLS to a Turnstile client (BoringSSL checks the server certificate's
extended key usage). ECDSA P-256 keys: small, fast to generate and to handshake.

:func:`ensure_local_pki` writes the files ``./scripts/up`` needs once, under the
state directory, and leaves existing ones alone (it re-issues a leaf only when it
is missing or expires within a day).
"""

from __future__ import annotations

import datetime
import ipaddress
import os
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from turnstile_platform.identity import server_name

_ONE_DAY = datetime.timedelta(days=1)


def _now() -> datetime.datetime:
    return datetime.datetime.now(datetime.UTC)


def _key_pem(key: ec.EllipticCurvePrivateKey) -> bytes:
    return key.private_bytes(
        serialization.Encoding.PEM,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


@dataclass(frozen=True)
class Leaf:
    """One issued certificate: PEM chain (leaf first) and its PEM private key."""

    cert_pem: bytes
    key_pem: bytes

    def write(self, cert_file: Path, key_file: Path) -> None:
        """Write both files atomically (a rename), the key readable by its owner only."""
        _write_atomic(key_file, self.key_pem, mode=0o600)
        _write_atomic(cert_file, self.cert_pem, mode=0o644)


class CertificateAuthority:
    """A self-signed CA that issues SPIFFE leaf certificates."""

    def __init__(self, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> None:
        self.key = key
        self.cert = cert

    @classmethod
    def create(cls, name: str = "Turnstile local CA", *, days: int = 3650) -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        now = _now()
        cert = (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(
                x509.KeyUsage(
                    digital_signature=True,
                    content_commitment=False,
                    key_encipherment=False,
                    data_encipherment=False,
                    key_agreement=False,
                    key_cert_sign=True,
                    crl_sign=True,
                    encipher_only=False,
                    decipher_only=False,
                ),
                critical=True,
            )
            .add_extension(
                x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False
            )
            .sign(key, hashes.SHA256())
        )
        return cls(key, cert)

    @classmethod
    def load(cls, cert_file: Path, key_file: Path) -> CertificateAuthority:
        key = serialization.load_pem_private_key(key_file.read_bytes(), password=None)
        if not isinstance(key, ec.EllipticCurvePrivateKey):
            raise ValueError(f"{key_file} is not an EC private key")
        return cls(key, x509.load_pem_x509_certificate(cert_file.read_bytes()))

    @property
    def cert_pem(self) -> bytes:
        return self.cert.public_bytes(serialization.Encoding.PEM)

    def write(self, cert_file: Path, key_file: Path) -> None:
        _write_atomic(key_file, _key_pem(self.key), mode=0o600)
        _write_atomic(cert_file, self.cert_pem, mode=0o644)

    def issue(
        self,
        spiffe_id: str | None,
        *,
        server: bool = False,
        dns_names: Iterable[str] = (),
        ip_addresses: Iterable[str] = (),
        days: float = 90,
        not_after: datetime.datetime | None = None,
        common_name: str | None = None,
        extra_uris: Iterable[str] = (),
        emails: Iterable[str] = (),
    ) -> Leaf:
        """A leaf certificate for ``spiffe_id`` (its one URI SAN), a client
        certificate only (``clientAuth``) unless ``server``: then also ``serverAuth``
        and, first of its DNS names, the server name its clients check.
        ``spiffe_id=None`` issues one without a URI SAN (tests of callers with no
        identity)."""
        key = ec.generate_private_key(ec.SECP256R1())
        now = _now()
        names: list[x509.GeneralName] = []
        if spiffe_id is not None:
            names.append(x509.UniformResourceIdentifier(spiffe_id))
        names += [x509.UniformResourceIdentifier(u) for u in extra_uris]
        if server and spiffe_id is not None:
            names.append(x509.DNSName(server_name(spiffe_id)))
        names += [x509.DNSName(d) for d in dns_names]
        names += [x509.IPAddress(ipaddress.ip_address(a)) for a in ip_addresses]
        names += [x509.RFC822Name(e) for e in emails]
        cn = common_name or spiffe_id or "turnstile"
        builder = (
            x509.CertificateBuilder()
            .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn[:64])]))
            .issuer_name(self.cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(not_after or now + datetime.timedelta(days=days))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.ExtendedKeyUsage(_usages(server)), critical=False)
            .add_extension(
                x509.AuthorityKeyIdentifier.from_issuer_public_key(self.key.public_key()),
                critical=False,
            )
        )
        if names:
            builder = builder.add_extension(x509.SubjectAlternativeName(names), critical=False)
        cert = builder.sign(self.key, hashes.SHA256())
        return Leaf(cert.public_bytes(serialization.Encoding.PEM), _key_pem(key))


def _usages(server: bool) -> list[x509.ObjectIdentifier]:
    if server:
        return [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    return [ExtendedKeyUsageOID.CLIENT_AUTH]


def _write_atomic(path: Path, data: bytes, *, mode: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "wb") as out:
        # A temporary file left by a crash keeps its old mode through O_CREAT: set it
        # before the key is written (SPEC O4: keys are 0600, the owner's alone).
        os.fchmod(out.fileno(), mode)
        out.write(data)
    os.replace(tmp, path)


def _expires_soon(cert_file: Path) -> bool:
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
    except (OSError, ValueError):
        return True
    return cert.not_valid_after_utc - _now() < _ONE_DAY


@dataclass(frozen=True)
class LocalIdentity:
    """Where one holder's files are: ``<dir>/<name>.crt`` and ``<dir>/<name>.key``."""

    name: str
    spiffe_id: str
    cert_file: Path
    key_file: Path


def ensure_local_pki(
    directory: Path,
    trust_domain: str,
    holders: dict[str, str],
    *,
    servers: Collection[str] = (),
    server_names: Iterable[str] = ("localhost",),
    server_ips: Iterable[str] = ("127.0.0.1", "::1"),
) -> tuple[Path, dict[str, LocalIdentity]]:
    """Make sure ``directory`` holds a CA (``ca.crt``/``ca.key``) and, for each
    ``name → SPIFFE path`` in ``holders``, a leaf certificate; returns the CA file
    and each holder's files. The holders named in ``servers`` get server
    certificates (their server name, ``server_names`` and ``server_ips``); the rest
    client certificates with no names. Existing valid files of the right shape are
    kept, so a second start of the stack reuses them (and clients already given the
    CA keep trusting it); a certificate of another shape (an older layout) is
    re-issued."""
    directory.mkdir(parents=True, exist_ok=True)
    os.chmod(directory, 0o700)
    ca_cert, ca_key = directory / "ca.crt", directory / "ca.key"
    if ca_cert.exists() and ca_key.exists() and not _expires_soon(ca_cert):
        ca = CertificateAuthority.load(ca_cert, ca_key)
    else:
        ca = CertificateAuthority.create()
        ca.write(ca_cert, ca_key)
        for stale in directory.glob("*.crt"):
            if stale != ca_cert:
                stale.unlink()
    dns, ips = list(server_names), list(server_ips)
    out: dict[str, LocalIdentity] = {}
    for name, path in holders.items():
        spiffe_id = f"spiffe://{trust_domain}/{path.lstrip('/')}"
        cert_file, key_file = directory / f"{name}.crt", directory / f"{name}.key"
        server = name in servers
        if (
            not key_file.exists()
            or _expires_soon(cert_file)
            or not _has_shape(cert_file, spiffe_id, server)
        ):
            leaf = (
                ca.issue(spiffe_id, server=True, dns_names=dns, ip_addresses=ips)
                if server
                else ca.issue(spiffe_id)
            )
            leaf.write(cert_file, key_file)
        out[name] = LocalIdentity(name, spiffe_id, cert_file, key_file)
    return ca_cert, out


def _has_shape(cert_file: Path, spiffe_id: str, server: bool) -> bool:
    """Whether the file is a certificate of ``spiffe_id`` with the role's usages
    (and, for a server, its server name)."""
    try:
        cert = x509.load_pem_x509_certificate(cert_file.read_bytes())
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        usages = cert.extensions.get_extension_for_class(x509.ExtendedKeyUsage).value
    except (OSError, ValueError, x509.ExtensionNotFound):
        return False
    if san.get_values_for_type(x509.UniformResourceIdentifier) != [spiffe_id]:
        return False
    if list(usages) != _usages(server):
        return False
    dns = san.get_values_for_type(x509.DNSName)
    return server_name(spiffe_id) in dns if server else not dns
