"""Telling a certificate problem from a server that is down, in one plain line.

gRPC reports every failed handshake as UNAVAILABLE, like a server that is not
there, and its core logs the details (``ssl_transport_security.cc`` …) on
stderr. The CLI silences that log (``GRPC_VERBOSITY=NONE``, set by
:func:`turnstile_cli.cli.run` before grpc is imported) and reads the failure
instead: what the handshake said, and, when it said too little (a server that
refused the client's certificate just closes the socket), what the certificate
files themselves show, read with ``cryptography`` only on this path (its import
would cost every command 0.1 s).

Each explained failure exits :attr:`turnstile_cli.exits.Exit.TRANSPORT` (5):
retrying will not help, a setting or a file must change.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509

    from turnstile_cli.context import ClientTls, Targets

#: What gRPC's handshake says when the server's certificate is not the expected one
#: (the same signs as :data:`turnstile_platform.health_check.WRONG_SERVER_SIGNS`).
WRONG_SERVER_SIGNS = ("Hostname Verification Check failed", "unsupported certificate purpose")
#: The client's own certificate or key could not be loaded.
BAD_CLIENT_SIGNS = ("Failed to create security handshaker", "Invalid private key")
#: The server's certificate is not issued by a CA the client trusts.
UNTRUSTED_SIGNS = ("CERTIFICATE_VERIFY_FAILED",)
#: A TLS client met a plaintext server.
PLAINTEXT_SERVER_SIGNS = ("WRONG_VERSION_NUMBER",)
#: The server closed the connection during the handshake (it refused the client's
#: certificate; or a plaintext client met a TLS server).
CLOSED_SIGNS = ("Socket closed", "Connection reset by peer")

_ADDRESS = re.compile(r"ipv[46]:(\S+?):? ")


@dataclass(frozen=True)
class Problem:
    """A transport failure explained: which kind, in one line."""

    #: UPPER_SNAKE like an ErrorInfo reason (``--json``'s ``error.reason``):
    #: WRONG_IDENTITY, UNTRUSTED_SERVER, KEY_MISMATCH, BAD_CLIENT_CERT,
    #: CERTIFICATE_EXPIRED, UNTRUSTED_CLIENT, PLAINTEXT_TO_TLS, TLS_TO_PLAINTEXT,
    #: HANDSHAKE_REFUSED.
    kind: str
    text: str


def explain(
    details: str, tls: ClientTls, targets: Targets, *, service: str | None = None
) -> Problem | None:
    """The plain-words cause of an UNAVAILABLE call's ``details``, or None when it
    looks like a server that is down or busy (the usual hint then applies).
    ``service``: the service called, when known (several may share an address)."""
    target = _target(details)
    where = f"the server at {target}" if target else "the server"
    if any(sign in details for sign in WRONG_SERVER_SIGNS):
        expected = getattr(targets, f"{service}_id") if service else _expected_id(target, targets)
        return Problem(
            "WRONG_IDENTITY",
            f"{where} is not the Turnstile service expected ({expected}): its certificate "
            "holds another SPIFFE ID or is no server certificate "
            "(TURNSTILE_<SERVICE>_SPIFFE_ID names whom to expect)",
        )
    if tls.plaintext:
        if any(sign in details for sign in CLOSED_SIGNS):
            return Problem(
                "PLAINTEXT_TO_TLS",
                f"{where} closed the connection: it expects TLS, and this CLI talks "
                "plaintext (TURNSTILE_PLAINTEXT); give it certificates instead",
            )
        return None
    if any(sign in details for sign in BAD_CLIENT_SIGNS):
        return _client_files(tls) or Problem(
            "BAD_CLIENT_CERT",
            f"the client certificate {tls.cert} or its key {tls.key} cannot be used",
        )
    if any(sign in details for sign in UNTRUSTED_SIGNS):
        reason = details.rsplit("CERTIFICATE_VERIFY_FAILED:", 1)[-1].strip().removesuffix(": OK")
        return Problem(
            "UNTRUSTED_SERVER",
            f"{where} has a certificate not issued by the CA in {tls.ca} "
            f"(a self-signed certificate, or another CA's: {reason or 'verify failed'})",
        )
    if any(sign in details for sign in PLAINTEXT_SERVER_SIGNS):
        return Problem(
            "TLS_TO_PLAINTEXT",
            f"{where} does not speak TLS: it serves plaintext (a stack started with "
            "--plaintext?); TURNSTILE_PLAINTEXT=true talks to it",
        )
    if any(sign in details for sign in CLOSED_SIGNS):
        local = _client_files(tls)
        if local is not None:
            return Problem(local.kind, f"{where} refused the connection: {local.text}")
        return Problem(
            "HANDSHAKE_REFUSED",
            f"{where} closed the connection during the TLS handshake: it refused the client "
            f"certificate {tls.cert} (issued for another deployment?), or it is not TLS",
        )
    return None


def _target(details: str) -> str | None:
    found = _ADDRESS.search(details)
    return found.group(1) if found else None


def _expected_id(target: str | None, targets: Targets) -> str:
    for name in ("admission", "substrate", "affinity"):
        if getattr(targets, name) == target:
            return str(getattr(targets, f"{name}_id"))
    return "the service expected"


def _client_files(tls: ClientTls) -> Problem | None:
    """What is wrong with the client's own files, read with ``cryptography``: a key
    that is not the certificate's, a certificate not issued by the CA bundle (so
    the server, trusting the same CA, refuses it), one expired or not yet valid."""
    if tls.cert is None or tls.key is None or tls.ca is None:
        return None
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    try:
        chain = x509.load_pem_x509_certificates(Path(tls.cert).read_bytes())
        key = serialization.load_pem_private_key(Path(tls.key).read_bytes(), password=None)
        cas = x509.load_pem_x509_certificates(Path(tls.ca).read_bytes())
    except (OSError, ValueError, TypeError) as error:
        return Problem("BAD_CLIENT_CERT", f"cannot read the certificate files: {error}")
    leaf = chain[0]
    public = serialization.PublicFormat.SubjectPublicKeyInfo
    encoding = serialization.Encoding.DER
    if key.public_key().public_bytes(encoding, public) != leaf.public_key().public_bytes(
        encoding, public
    ):
        return Problem(
            "KEY_MISMATCH",
            f"the private key {tls.key} does not belong to the certificate {tls.cert}",
        )
    now = datetime.now(UTC)
    if leaf.not_valid_after_utc < now:
        return Problem(
            "CERTIFICATE_EXPIRED",
            f"the client certificate {tls.cert} expired on {leaf.not_valid_after_utc:%Y-%m-%d}",
        )
    if leaf.not_valid_before_utc > now:
        return Problem(
            "CERTIFICATE_EXPIRED",
            f"the client certificate {tls.cert} is valid only from "
            f"{leaf.not_valid_before_utc:%Y-%m-%d %H:%M} UTC",
        )
    if not any(_issued_by(cert, ca) for cert in chain for ca in cas):
        self_signed = leaf.issuer == leaf.subject
        return Problem(
            "UNTRUSTED_CLIENT",
            f"the client certificate {tls.cert} is "
            + ("self-signed" if self_signed else "issued by another CA")
            + f", not by the CA in {tls.ca}",
        )
    return None


def _issued_by(cert: x509.Certificate, ca: x509.Certificate) -> bool:
    from cryptography.exceptions import InvalidSignature

    try:
        cert.verify_directly_issued_by(ca)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True
