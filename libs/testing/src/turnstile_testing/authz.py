"""Helpers of the authorization tests: call every RPC as some identity, classify the
outcome, and snapshot Redis and PostgreSQL to prove a refused call changed nothing
(:class:`RedisState` also tells a key that expired from one that was written)."""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import grpc
import grpc.aio
import redis.asyncio as aioredis
from grpc.aio import EOF  # type: ignore[attr-defined]  # exported, not in the stubs

from turnstile_platform.authz.authorizer import Authorizer
from turnstile_platform.errors import decode

#: What the authorization layer answers with; anything else means the handler ran.
REFUSALS = (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED)

#: The ``ErrorInfo`` reasons of the authorization layer's refusals. A handler may
#: itself answer PERMISSION_DENIED with another reason (the relay refusing a worker
#: credential): that call passed authorization.
AUTHZ_REASONS = frozenset({"UNAUTHENTICATED", "PERMISSION_DENIED"})

Invoke = Callable[[grpc.aio.Channel], Awaitable[object]]


class _AllowAll(Authorizer):
    """An authorizer that checks nothing (see :func:`without_authorization`)."""

    async def authorize(self, context: Any, method: str, reflection: bool, request: Any) -> None:
        return None


def without_authorization() -> None:
    """Make every ``GrpcService`` built after this in the process allow every call
    unchecked under mutual TLS: a benchmark's ``mtls`` mode prices TLS apart from
    the authorization check (the service itself cannot run mTLS without a policy)."""
    import turnstile_platform.server

    setattr(turnstile_platform.server, "Authorizer", _AllowAll)  # noqa: B010


async def outcome(channel: grpc.aio.Channel, invoke: Invoke) -> grpc.StatusCode:
    """OK, or the status code the call failed with."""
    try:
        await invoke(channel)
    except grpc.aio.AioRpcError as error:
        return error.code()
    return grpc.StatusCode.OK


async def authorized(channel: grpc.aio.Channel, invoke: Invoke) -> bool:
    """Whether the call got past authorization: served, or refused by its handler."""
    try:
        await invoke(channel)
    except grpc.aio.AioRpcError as error:
        return decode(error).reason not in AUTHZ_REASONS
    return True


async def refusal(
    channel: grpc.aio.Channel, invoke: Invoke
) -> tuple[grpc.StatusCode, str, dict[str, str]]:
    """(code, ErrorInfo reason, ErrorInfo metadata) of a refused call."""
    try:
        await invoke(channel)
    except grpc.aio.AioRpcError as error:
        rich = decode(error)
        return rich.code, rich.reason, dict(rich.metadata)
    raise AssertionError("the call was served")


def unary(method: str, request: Any) -> Invoke:
    """Call ``/pkg.Service/Method`` with ``request`` (any response type)."""

    async def invoke(channel: grpc.aio.Channel) -> object:
        call = channel.unary_unary(
            method, request_serializer=type(request).SerializeToString, response_deserializer=None
        )
        return await call(request, timeout=10)

    return invoke


def stream(method: str, requests: list[Any]) -> Invoke:
    """Open a bidirectional stream, send ``requests``, read one response.

    Requests are written with ``call.write`` and a failed write is ignored: a
    refused stream is aborted by the server before it reads anything, and the
    status to assert is the one the server sent, which ``read`` raises (a request
    iterator racing the abort can instead end the call with a client-side error)."""

    async def invoke(channel: grpc.aio.Channel) -> object:
        call = channel.stream_stream(
            method,
            request_serializer=type(requests[0]).SerializeToString,
            response_deserializer=None,
        )(None, timeout=10)  # None: requests are written with call.write
        try:
            with contextlib.suppress(grpc.aio.AioRpcError, grpc.aio.UsageError):
                for request in requests:
                    await call.write(request)
            response = await call.read()
            return None if response is EOF else response
        finally:
            call.cancel()

    return invoke


#: The decision log's keys start so after the prefix (SPEC Q3, N3: its streams, their
#: sandbox streams and index): it records calls, refused ones too, rather than
#: holding state a call changes, so snapshots leave it out; the tests of the log
#: (and of dry runs, which log nothing) read it themselves.
DECISION_LOG_MARK = b"{adm}:decisions"


def is_state(key: bytes) -> bool:
    """Whether ``key`` is state a call could change (not the decision log)."""
    at = key.find(DECISION_LOG_MARK)
    if at < 0:
        return True
    rest = key[at + len(DECISION_LOG_MARK) :]
    return not (rest == b"" or rest.startswith(b":"))


async def redis_snapshot(client: aioredis.Redis, prefix: str) -> dict[bytes, bytes | None]:
    """Every key under ``prefix`` (but the decision log) and its serialized value (DUMP)."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
    return {key: await client.dump(key) for key in sorted(keys) if is_state(key)}


@dataclass(frozen=True)
class RedisState:
    """Every key under a prefix: its serialized value (DUMP) and absolute expiry in ms
    (PEXPIRETIME: -1 for none), read at ``now_ms`` (the server's clock)."""

    keys: dict[bytes, tuple[bytes | None, int]]
    now_ms: int

    def changes_since(self, before: RedisState) -> dict[bytes, str]:
        """What was written between ``before`` and this state, by key: a key created,
        rewritten, given another expiry, or gone before its expiry. A key that merely
        expired (its expiry passed by now) is no change: nobody wrote it."""
        changes: dict[bytes, str] = {}
        for key, (value, expires) in before.keys.items():
            now = self.keys.get(key)
            if now is None:
                if not 0 <= expires <= self.now_ms:
                    changes[key] = "deleted"
            elif now != (value, expires):
                changes[key] = "rewritten" if now[0] != value else "expiry changed"
        for key in self.keys.keys() - before.keys.keys():
            changes[key] = "created"
        return changes


async def redis_state(client: aioredis.Redis, prefix: str) -> RedisState:
    """:class:`RedisState` of every key under ``prefix`` but the decision log."""
    keys = [key async for key in client.scan_iter(match=f"{prefix}*", count=1000)]
    out: dict[bytes, tuple[bytes | None, int]] = {}
    for key in sorted(k for k in keys if is_state(k)):
        value = await client.dump(key)
        expires = int(await client.pexpiretime(key))
        if value is not None and expires != -2:  # -2: it expired between the two reads
            out[key] = (value, expires)
    seconds, micros = await client.time()
    return RedisState(out, int(seconds) * 1000 + int(micros) // 1000)


async def postgres_snapshot(database_url: str) -> dict[str, list[tuple[Any, ...]]]:
    """Every row of every table in the public schema, sorted."""
    conn = await asyncpg.connect(database_url)
    try:
        tables = await conn.fetch(
            "SELECT tablename FROM pg_tables WHERE schemaname = 'public' ORDER BY tablename"
        )
        out: dict[str, list[tuple[Any, ...]]] = {}
        for row in tables:
            # Table names come from pg_tables, not from input.
            rows = await conn.fetch(f'SELECT * FROM "{row["tablename"]}"')  # noqa: S608
            out[row["tablename"]] = sorted((tuple(r.values()) for r in rows), key=repr)
        return out
    finally:
        await conn.close()
