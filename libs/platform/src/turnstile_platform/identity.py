"""Who is calling: the SPIFFE ID of the verified peer certificate (SPEC Z1, O5).

The identity comes only from the TLS handshake, never from metadata a caller
can write: the verified peer certificate's URI SANs, read from its
SubjectAlternativeName x509 extension (typed: a DNS, e-mail or IP SAN never
counts, whatever it spells). There must be exactly one URI SAN and it must be a
well-formed SPIFFE ID (X.509-SVID rules); a certificate with any other URI SAN
beside it (``urn:``, ``https:``) has no identity. Without an identity a caller
gets UNAUTHENTICATED for everything but health.

Why the PEM and not gRPC's ready-made properties: ``peer_identities()`` is the
untyped list of every SAN (a DNS SAN reading ``spiffe://…`` looks the same as a
URI SAN), and grpcio's Python layer turns each property into ``bytes`` at its
first NUL byte, so ``peer_uri``/``peer_spiffe_id`` would read a URI SAN
``spiffe://td/client/acme\\x00x`` as ``…/client/acme``. The PEM certificate
(``x509_pem_cert``, base64 text) has neither problem; it is parsed once per
distinct certificate (``cryptography``) and the answer cached by its bytes, so a
call pays ``auth_context()`` and a dict lookup (a few µs; see docs/security.md).

A caller without any certificate never gets this far on a TLS port: the
server requires a client certificate, so the handshake fails and the client
sees UNAVAILABLE before any call exists.
"""

from __future__ import annotations

import string
from typing import Any

import grpc.aio

_DOMAIN_CHARS = frozenset(string.ascii_lowercase + string.digits + ".-_")
_PATH_CHARS = frozenset(string.ascii_letters + string.digits + ".-_")

SAN_KEY = "x509_subject_alternative_name"
PEM_KEY = "x509_pem_cert"

_CACHE_LIMIT = 1024
_seen: dict[bytes, str | None] = {}


def peer_identity(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The caller's SPIFFE ID, or None (plaintext, or a certificate without exactly
    one URI SAN that is a SPIFFE ID)."""
    # Plaintext has no certificate in the auth context; a certificate without a
    # SAN extension parses to no identity (the CN is not one).
    pem = next(iter(context.auth_context().get(PEM_KEY, ())), b"")
    return identity_of_pem(pem) if pem else None


def identity_of_pem(pem: bytes) -> str | None:
    """:func:`spiffe_id_of` the PEM certificate, cached per certificate."""
    found = _seen.get(pem, "")
    if found != "":
        return found
    identity = spiffe_id_of(pem)
    if len(_seen) >= _CACHE_LIMIT:
        _seen.clear()
    _seen[pem] = identity
    return identity


def spiffe_id_of(pem: bytes) -> str | None:
    """The SPIFFE ID of a PEM certificate: its one URI SAN (from the x509
    extension), when it is a valid SPIFFE ID; None otherwise."""
    # Imported here: channels (and so the CLI) use this module's name rules but
    # never parse a certificate, and ``cryptography`` costs start-up time.
    from cryptography import x509

    try:
        cert = x509.load_pem_x509_certificate(pem)
        san = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
        uris = san.get_values_for_type(x509.UniformResourceIdentifier)
    except (ValueError, x509.ExtensionNotFound):
        return None
    if len(uris) != 1:
        return None
    try:
        parse_spiffe_id(uris[0])
    except ValueError:
        return None
    return uris[0]


def parse_spiffe_id(value: str) -> tuple[str, str]:
    """(trust domain, path) of ``spiffe://<trust domain>/<path>``; ValueError otherwise.

    The SPIFFE ID rules: a lower-case trust domain of letters, digits, ``.-_``; a
    path of non-empty segments of letters, digits and ``.-_`` other than ``.`` and
    ``..``; no query, fragment, port or user info."""
    if not value.startswith("spiffe://"):
        raise ValueError(f"{value!r} is not a SPIFFE ID (spiffe://<trust-domain>/<path>)")
    domain, slash, path = value[len("spiffe://") :].partition("/")
    if not domain or not set(domain) <= _DOMAIN_CHARS:
        raise ValueError(f"{value!r} has no valid trust domain")
    if slash:
        segments = path.split("/")
        if any(s in ("", ".", "..") or not set(s) <= _PATH_CHARS for s in segments):
            raise ValueError(f"{value!r} has an invalid path")
    return domain, path


def server_name(spiffe_id: str) -> str:
    """The DNS name a server holding ``spiffe_id`` carries beside it, and which its
    clients check (SPEC O5; docs/security.md): the path segments reversed, then the
    trust domain — ``spiffe://turnstile.local/service/admission`` →
    ``admission.service.turnstile.local``. ValueError for an ID that has no such
    name (no path, or a segment that is not a DNS label)."""
    domain, path = parse_spiffe_id(spiffe_id)
    segments = path.split("/") if path else []
    if not segments or not all(_is_label(s) for s in segments):
        raise ValueError(
            f"{spiffe_id!r} cannot name a server: its path segments must be DNS labels "
            "(lower-case letters, digits and '-', no dots)"
        )
    return ".".join([*reversed(segments), domain])


_LABEL_CHARS = frozenset(string.ascii_lowercase + string.digits + "-")


def _is_label(segment: str) -> bool:
    return (
        0 < len(segment) <= 63
        and set(segment) <= _LABEL_CHARS
        and not segment.startswith("-")
        and not segment.endswith("-")
    )
