"""RetryInfo-driven retries, over a real socket to a real gRPC server that answers
as a Turnstile service does when a dependency is down: UNAVAILABLE with RetryInfo
(retried, bounded), or without it, or a refusal (never retried)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field

import grpc
import grpc.aio
import pytest

from turnstile_client import Refused, Retry, TurnstileClient, TurnstileError
from turnstile_contracts import admission_pb2, admission_pb2_grpc
from turnstile_platform.errors import RichError


@dataclass
class Scripted(admission_pb2_grpc.AdmissionServiceServicer):
    """Fails the first ``failures`` Admits with ``error``, then admits."""

    error: RichError
    failures: int
    calls: int = 0
    seen: list[str] = field(default_factory=list)

    async def Admit(
        self, request: admission_pb2.AdmitRequest, context: grpc.aio.ServicerContext[object, object]
    ) -> admission_pb2.AdmitResponse:
        self.calls += 1
        if self.calls <= self.failures:
            status = self.error.to_status()
            await context.abort(status.code, status.details, status.trailing_metadata)
        return admission_pb2.AdmitResponse(decision=admission_pb2.DECISION_ADMITTED, hold_id="h1")


def _unavailable(retry_after_s: float | None) -> RichError:
    return RichError(
        code=grpc.StatusCode.UNAVAILABLE,
        message="redis is unavailable; retry",
        reason="DEPENDENCY_UNAVAILABLE",
        metadata={"dependency": "redis"},
        retry_after_s=retry_after_s,
    )


@pytest.fixture
async def serve() -> AsyncIterator[object]:
    servers: list[grpc.aio.Server] = []

    async def start(servicer: Scripted) -> str:
        server = grpc.aio.server()
        admission_pb2_grpc.add_AdmissionServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        servers.append(server)
        return f"127.0.0.1:{port}"

    yield start
    for server in servers:
        await server.stop(None)


async def test_unavailable_with_retry_info_is_retried_until_it_succeeds(serve: object) -> None:
    servicer = Scripted(_unavailable(0.01), failures=2)  # type: ignore[abstract]  # only Admit is served
    address = await serve(servicer)  # type: ignore[operator]
    async with TurnstileClient.connect(admission=address, tls=None, retry=Retry(3)) as client:
        response = await client.admit("sb-1", "acme")
    assert (response.hold_id, servicer.calls) == ("h1", 3)


async def test_retries_are_bounded_and_the_last_error_is_raised(serve: object) -> None:
    servicer = Scripted(_unavailable(0.01), failures=10)  # type: ignore[abstract]  # only Admit is served
    address = await serve(servicer)  # type: ignore[operator]
    async with TurnstileClient.connect(admission=address, tls=None, retry=Retry(3)) as client:
        with pytest.raises(TurnstileError) as raised:
            await client.admit("sb-1", "acme")
    assert servicer.calls == 3
    assert (raised.value.code, raised.value.reason) == (
        grpc.StatusCode.UNAVAILABLE,
        "DEPENDENCY_UNAVAILABLE",
    )
    assert raised.value.metadata["dependency"] == "redis"


async def test_unavailable_without_retry_info_is_not_retried(serve: object) -> None:
    servicer = Scripted(_unavailable(None), failures=1)  # type: ignore[abstract]  # only Admit is served
    address = await serve(servicer)  # type: ignore[operator]
    async with TurnstileClient.connect(admission=address, tls=None) as client:
        with pytest.raises(TurnstileError):
            await client.admit("sb-1", "acme")
    assert servicer.calls == 1


async def test_a_wait_past_the_deadline_is_not_attempted(serve: object) -> None:
    servicer = Scripted(_unavailable(5.0), failures=1)  # type: ignore[abstract]  # only Admit is served
    address = await serve(servicer)  # type: ignore[operator]
    retry = Retry(attempts=3, max_delay_s=5.0)
    async with TurnstileClient.connect(
        admission=address, tls=None, retry=retry, deadline_s=3.0
    ) as client:
        with pytest.raises(TurnstileError) as raised:
            await client.admit("sb-1", "acme")
    assert servicer.calls == 1
    assert raised.value.retry_after_s == 5.0


async def test_a_refusal_error_is_refused_and_never_retried(serve: object) -> None:
    refusal = RichError(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        message="refused by the cap policy",
        reason="CAP_EXCEEDED",
        metadata={"key": "acme", "policy": "cap", "limit": "2", "current": "2"},
        retry_after_s=1.0,
    )
    servicer = Scripted(refusal, failures=1)  # type: ignore[abstract]  # only Admit is served
    address = await serve(servicer)  # type: ignore[operator]
    async with TurnstileClient.connect(admission=address, tls=None) as client:
        with pytest.raises(Refused) as raised:
            await client.admit("sb-1", "acme")
    assert servicer.calls == 1
    got = raised.value
    assert (got.key, got.policy, got.limit, got.current, got.retry_after_s) == (
        "acme",
        "cap",
        2,
        2,
        1.0,
    )
