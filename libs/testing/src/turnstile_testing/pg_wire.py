"""Counting PostgreSQL round trips on the wire, between a client and the server.

Every exchange a client starts with PostgreSQL — a simple ``Query``, or an extended
protocol batch (``Parse``/``Bind``/``Execute``) ended by ``Sync`` — is answered by
exactly one ``ReadyForQuery`` message (type ``Z``) once the server is done with it,
and so is the end of the start-up. Counting the ``Z`` messages the server sends
therefore counts round trips, whatever the client library believes it sent: a pool's
reset query on release, a ``BEGIN``, a prepare on a statement-cache miss all show.

Use it as a :class:`~turnstile_testing.tcp_proxy.TcpProxy` observer between the client
and a server that does not encrypt the connection (``sslmode=disable``): TLS bytes
cannot be parsed.
"""

from __future__ import annotations

from collections.abc import Callable

_HEADER = 5  # type byte + int32 length (the length counts itself, not the type byte)


class ReadyForQueryCounter:
    """Counts the server's ``ReadyForQuery`` messages over every observed connection."""

    def __init__(self) -> None:
        self.count = 0

    def observer(self) -> Callable[[bytes], None]:
        """A sink for one connection's server-to-client bytes (``TcpProxy(observe=...)``)."""
        buffer = bytearray()

        def sink(data: bytes) -> None:
            buffer.extend(data)
            while len(buffer) >= _HEADER:
                length = int.from_bytes(buffer[1:5], "big")
                if len(buffer) < 1 + length:
                    return
                if buffer[0] == ord("Z"):
                    self.count += 1
                del buffer[: 1 + length]

        return sink
