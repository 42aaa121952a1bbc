"""Transport security for every Turnstile server and channel (SPEC Z1, Z4, Z5).

One place builds credentials from certificate files; no other module calls
``grpc.ssl_*``. Servers require a client certificate signed by the CA bundle and
answer gRPC's per-handshake fetcher with :class:`ReloadingServerFiles`, which
re-reads the files only when their ``stat`` changed: a rotated certificate serves
the next connection, with no restart and no in-flight call failed. Channels keep
their certificate for life (grpc reads the bytes once), so long-lived holders
(:mod:`turnstile_platform.peers`) ask :class:`ChannelCredentialsSource` whether the
files changed and rebuild. gRPC's hostname check never reads the URI SAN, so each
server certificate also carries the DNS name derived from its SPIFFE ID
(:func:`~turnstile_platform.identity.server_name`) and a channel overrides the
target name with the one it expects (:func:`server_check_options`, SPEC O5).
Plaintext exists only when enabled and only on loopback
(:func:`check_plaintext_allowed`). The design and its limits are in
docs/security.md.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import grpc

from turnstile_platform.identity import server_name

log = logging.getLogger(__name__)

#: The channel argument whose name the handshake checks the server certificate against.
TARGET_NAME_OVERRIDE = "grpc.ssl_target_name_override"

LOOPBACK_NAMES = frozenset({"localhost", "ip6-localhost", "ip6-loopback"})


class TransportSecurityError(ValueError):
    """The settings ask for something unsafe or incomplete; the message says what to set."""


@dataclass(frozen=True)
class TlsFiles:
    """A holder's certificate chain, its private key and the CA bundle it trusts."""

    cert_file: Path
    key_file: Path
    ca_file: Path

    def read(self) -> tuple[bytes, bytes, bytes]:
        """(certificate chain, private key, CA bundle) as PEM bytes."""
        return self.cert_file.read_bytes(), self.key_file.read_bytes(), self.ca_file.read_bytes()

    def signature(self) -> tuple[tuple[int, int, int], ...]:
        """What changes when any file is replaced: (inode, size, mtime) of each.

        ``stat`` follows symlinks, so the atomic symlink swap a Kubernetes Secret or
        ConfigMap volume does counts as a change too."""
        out = []
        for path in (self.cert_file, self.key_file, self.ca_file):
            st = os.stat(path)
            out.append((st.st_ino, st.st_size, st.st_mtime_ns))
        return tuple(out)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a bind address or a target's host part) is loopback only."""
    host = host.strip("[]")
    if host.lower() in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_plaintext_allowed(host: str, what: str) -> None:
    """Raise unless ``host`` is loopback: plaintext never leaves the machine (Z5)."""
    if not is_loopback(host):
        raise TransportSecurityError(
            f"{what}: plaintext was enabled (TURNSTILE_PLAINTEXT) but the address {host!r} "
            "is not loopback; plaintext is allowed only on 127.0.0.1/::1/localhost. Give "
            "certificate files (TURNSTILE_TLS_CERT_FILE, TURNSTILE_TLS_KEY_FILE, "
            "TURNSTILE_TLS_CA_FILE) instead."
        )


def require_files(
    cert_file: Path | None, key_file: Path | None, ca_file: Path | None, what: str
) -> TlsFiles:
    """The three files, or a start-up error naming the missing settings."""
    missing = [
        name
        for name, value in (
            ("TLS_CERT_FILE", cert_file),
            ("TLS_KEY_FILE", key_file),
            ("TLS_CA_FILE", ca_file),
        )
        if value is None
    ]
    if missing:
        raise TransportSecurityError(
            f"{what}: mutual TLS needs {', '.join(missing)} (settings prefix TURNSTILE_); "
            "plaintext is only for loopback development, with TURNSTILE_PLAINTEXT=true"
        )
    assert cert_file is not None
    assert key_file is not None
    assert ca_file is not None
    files = TlsFiles(cert_file, key_file, ca_file)
    for path in (cert_file, key_file, ca_file):
        if not path.is_file():
            raise TransportSecurityError(f"{what}: {path} does not exist or is not a file")
    return files


class ReloadingServerFiles:
    """The certificate-configuration fetcher of a server's dynamic credentials.

    gRPC calls it (from its own threads) before every new connection's
    handshake; it returns a new configuration only when the files changed. A
    half-written set (a key that does not match, an unreadable file) is logged and
    the previous configuration stays in use; the next connection tries again.
    """

    def __init__(self, files: TlsFiles) -> None:
        self.files = files
        self._lock = threading.Lock()
        self._signature = files.signature()
        self.initial = self._configuration()
        self.reloads = 0

    def _configuration(self) -> grpc.ServerCertificateConfiguration:
        cert, key, ca = self.files.read()
        return grpc.ssl_server_certificate_configuration([(key, cert)], root_certificates=ca)

    def __call__(self) -> grpc.ServerCertificateConfiguration | None:
        try:
            signature = self.files.signature()
        except OSError:
            return None
        if signature == self._signature:
            return None
        with self._lock:
            if signature == self._signature:
                return None
            try:
                configuration = self._configuration()
            except (OSError, ValueError):
                log.warning("certificate files changed but could not be read; keeping the old")
                return None
            self._signature = signature
            self.reloads += 1
        log.info("server certificate files changed: new connections use them")
        return configuration


def server_credentials(files: TlsFiles) -> grpc.ServerCredentials:
    """mTLS server credentials that re-read ``files`` when they change."""
    fetcher = ReloadingServerFiles(files)
    # grpc-stubs type the fetcher as never returning None; grpc documents None as
    # "no change", which is what most calls return.
    return grpc.dynamic_ssl_server_credentials(
        fetcher.initial,
        fetcher,  # type: ignore[arg-type]  # None is "no change" (see above)
        require_client_authentication=True,
    )


def server_check_options(server_id: str | None) -> list[tuple[str, str]]:
    """Channel arguments that make the TLS handshake refuse every server but the
    holder of ``server_id`` (its certificate must carry the derived server name;
    see the module docstring). None: the default check of the target's host name."""
    if server_id is None:
        return []
    return [(TARGET_NAME_OVERRIDE, server_name(server_id))]


class ChannelCredentialsSource:
    """Client credentials from files, whether the files changed since, and the
    channel arguments that check the server is ``server_id``."""

    def __init__(self, files: TlsFiles, server_id: str | None = None) -> None:
        self.files = files
        self.server_id = server_id
        self.options = server_check_options(server_id)
        self._signature = files.signature()
        cert, key, ca = files.read()
        self.credentials = grpc.ssl_channel_credentials(
            root_certificates=ca, private_key=key, certificate_chain=cert
        )

    def changed(self) -> bool:
        """True when any file was replaced since these credentials were built."""
        try:
            return self.files.signature() != self._signature
        except OSError:
            return False


def channel_credentials(files: TlsFiles) -> grpc.ChannelCredentials:
    """mTLS channel credentials (read now; see the module docstring on rotation)."""
    return ChannelCredentialsSource(files).credentials


class TransportSettings(Protocol):
    """The settings fields this module reads (every ``ServiceSettings`` has them)."""

    @property
    def plaintext(self) -> bool: ...
    @property
    def tls_cert_file(self) -> Path | None: ...
    @property
    def tls_key_file(self) -> Path | None: ...
    @property
    def tls_ca_file(self) -> Path | None: ...


def server_files(settings: TransportSettings, host: str, what: str) -> TlsFiles | None:
    """The server's files, or None for (allowed) plaintext; raises on anything unsafe."""
    if settings.plaintext:
        check_plaintext_allowed(host, what)
        return None
    return require_files(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file, what)


def client_source(
    settings: TransportSettings, target: str, what: str, *, server_id: str
) -> ChannelCredentialsSource | None:
    """Credentials for a channel to ``target``, whose server must hold the SPIFFE ID
    ``server_id`` (:attr:`ChannelCredentialsSource.options`), or None for (allowed)
    plaintext."""
    if settings.plaintext:
        for host in target_hosts(target):
            check_plaintext_allowed(host, what)
        return None
    files = require_files(settings.tls_cert_file, settings.tls_key_file, settings.tls_ca_file, what)
    try:
        return ChannelCredentialsSource(files, server_id)
    except ValueError as error:
        raise TransportSecurityError(f"{what}: the expected server identity: {error}") from None


def target_hosts(target: str) -> list[str]:
    """The host of every address a gRPC target names: ``host:port``, ``[v6]:port``,
    ``dns:///host:port``, or an address list (``ipv4:a:p,b:p``, ``ipv6:[a]:p,[b]:p``),
    as a worker names several relay replicas."""
    scheme, sep, rest = target.partition(":")
    if sep and scheme in ("ipv4", "ipv6") and not rest.startswith("//"):
        return [_address_host(address) for address in rest.split(",")]
    return [_address_host(target.split(":///", 1)[-1])]


def _address_host(address: str) -> str:
    if address.startswith("["):
        return address[1 : address.find("]")]
    host, sep, _port = address.rpartition(":")
    return host if sep else address
