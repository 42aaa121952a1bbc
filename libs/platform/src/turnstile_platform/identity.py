"""Who is calling: the SPIFFE ID of the verified peer certificate (SPEC Z1).

The identity comes only from the TLS handshake, never from metadata a caller
can write. gRPC core puts the peer certificate's URI SAN in the auth context
as ``peer_spiffe_id`` when the certificate carries exactly one URI SAN and it is
a well-formed SPIFFE ID (X.509-SVID rules); otherwise the key is absent and
the caller has no identity (UNAUTHENTICATED for everything but health).

A caller without any certificate never gets this far on a TLS port: the
server requires a client certificate, so the handshake fails and the client
sees UNAVAILABLE before any call exists.
"""

from __future__ import annotations

from typing import Any

import grpc.aio

SPIFFE_KEY = "peer_spiffe_id"


def peer_identity(context: grpc.aio.ServicerContext[Any, Any]) -> str | None:
    """The caller's SPIFFE ID, or None (plaintext, or a certificate without one)."""
    values = list(context.auth_context().get(SPIFFE_KEY, ()))
    if len(values) != 1:
        return None
    value: bytes = values[0]
    return value.decode("ascii", errors="replace")


def parse_spiffe_id(value: str) -> tuple[str, str]:
    """(trust domain, path) of ``spiffe://<trust domain>/<path>``; ValueError otherwise."""
    if not value.startswith("spiffe://"):
        raise ValueError(f"{value!r} is not a SPIFFE ID (spiffe://<trust-domain>/<path>)")
    domain, _, path = value[len("spiffe://") :].partition("/")
    if not domain:
        raise ValueError(f"{value!r} has no trust domain")
    return domain, path


def last_segment(spiffe_id: str) -> str:
    """The client id a ``self`` rule grants: the identity's last path segment
    (``spiffe://td/client/acme`` → ``acme``)."""
    return spiffe_id.rstrip("/").rpartition("/")[2]
