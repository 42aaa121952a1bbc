"""What reading the caller's identity costs each call (SPEC O5), in one run.

Every authorized call (``Admit`` first among them) starts with
:func:`turnstile_platform.identity.peer_identity`. It reads the verified PEM
certificate from ``auth_context()`` and looks the parsed identity up by it; the
untyped ``peer_identities()`` lookup it replaced was cheaper but could not tell a
DNS SAN from a URI SAN. This prints, inside a real mTLS call on this machine, the
best of five rounds of each, in µs per call:

* ``untyped lookup (before)`` — the untyped SAN list cached by its text (the
  lookup before SPEC O5, which a DNS SAN spelled as a SPIFFE ID fooled);
* ``auth_context()`` — the copy of every property the strict rule needs;
* ``peer_identity()`` — the strict rule, certificate already parsed (every call
  but a certificate's first);
* ``first sight`` — parsing a certificate never seen (once per certificate).

    uv run python services/admission/bench/bench_peer_identity.py
"""

from __future__ import annotations

import argparse
import asyncio
import time
from collections.abc import Callable
from typing import Any

import grpc
import grpc.aio

from turnstile_platform import identity
from turnstile_platform.pki import CertificateAuthority

Context = grpc.aio.ServicerContext[Any, Any]


_untyped_seen: dict[tuple[bytes, ...], str | None] = {}


def _untyped(context: Context) -> str | None:
    """The lookup before SPEC O5: the untyped SAN list, cached by its text."""
    if context.peer_identity_key() != identity.SAN_KEY:
        return None
    names = tuple(context.peer_identities() or ())
    found = _untyped_seen.get(names, "")
    if found == "":
        uris = [n for n in names if b"://" in n]
        found = _untyped_seen[names] = uris[0].decode() if len(uris) == 1 else None
    return found


def _best_us(fn: Callable[[Context], object], context: Context, calls: int) -> float:
    fn(context)
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(calls):
            fn(context)
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    return best


async def main(calls: int) -> None:
    ca = CertificateAuthority.create()
    server_leaf = ca.issue("spiffe://bench.local/service/admission", server=True)
    client_leaf = ca.issue("spiffe://bench.local/client/acme")
    figures: dict[str, float] = {}

    async def measure(request: bytes, context: Context) -> bytes:
        figures["untyped lookup (before)"] = _best_us(_untyped, context, calls)
        figures["auth_context()"] = _best_us(lambda c: c.auth_context(), context, calls)
        figures["peer_identity()"] = _best_us(identity.peer_identity, context, calls)
        identity._seen.clear()
        start = time.perf_counter()
        assert identity.peer_identity(context) == "spiffe://bench.local/client/acme"
        figures["first sight"] = (time.perf_counter() - start) * 1e6
        return request

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(measure)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("b.B", {"M": handler}),))
    credentials = grpc.ssl_server_credentials(
        [(server_leaf.key_pem, server_leaf.cert_pem)], ca.cert_pem, require_client_auth=True
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    await server.start()
    client = grpc.ssl_channel_credentials(ca.cert_pem, client_leaf.key_pem, client_leaf.cert_pem)
    options = [("grpc.ssl_target_name_override", "admission.service.bench.local")]
    try:
        async with grpc.aio.secure_channel(f"127.0.0.1:{port}", client, options=options) as ch:
            await ch.unary_unary("/b.B/M", None, None)(b"")
    finally:
        await server.stop(None)
    for name, value in figures.items():
        print(f"{name:26s} {value:8.2f} µs")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20_000)
    asyncio.run(main(parser.parse_args().calls))
