"""Who is calling: the SPIFFE ID of the verified peer certificate (SPEC Z1).

The identity comes only from the TLS handshake, never from metadata a caller
can write: the verified peer certificate's one URI SAN, when it is a well-formed
SPIFFE ID (X.509-SVID rules; gRPC core applies the same rule for the
``peer_spiffe_id`` auth-context property). Otherwise the caller has no identity
(UNAUTHENTICATED for everything but health).

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

SPIFFE_KEY = "peer_spiffe_id"
SAN_KEY = "x509_subject_alternative_name"

_CACHE_LIMIT = 4096
_seen: dict[tuple[bytes, ...], str | None] = {}


def peer_identity(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The caller's SPIFFE ID, or None (plaintext, or a certificate without one).

    The certificate's subject alternative names come from
    ``context.peer_identities()`` (about 0.5 µs), not ``auth_context()`` (about
    15 µs: it copies every property, the PEM certificate included), and the SPIFFE
    rule is applied here as gRPC core applies it for ``peer_spiffe_id``: exactly one
    URI SAN, and it is a well-formed SPIFFE ID. Results are cached per SAN list.
    """
    if context.peer_identity_key() != SAN_KEY:
        return None  # plaintext, or a certificate without SANs (the CN is not an identity)
    names = tuple(context.peer_identities() or ())
    found = _seen.get(names, "")
    if found != "":
        return found
    identity = _spiffe_of(names)
    if len(_seen) >= _CACHE_LIMIT:
        _seen.clear()
    _seen[names] = identity
    return identity


def _spiffe_of(names: tuple[bytes, ...]) -> str | None:
    # DNS names, IP addresses and e-mail addresses never contain "://": URIs do.
    uris = [n for n in names if b"://" in n]
    if len(uris) != 1:
        return None
    try:
        value = uris[0].decode("ascii")
        parse_spiffe_id(value)
    except (UnicodeDecodeError, ValueError):
        return None
    return value


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


def last_segment(spiffe_id: str) -> str:
    """The client id a ``self`` rule grants: the identity's last path segment
    (``spiffe://td/client/acme`` → ``acme``)."""
    return spiffe_id.rstrip("/").rpartition("/")[2]
