"""Rich errors travel from a server's RichError to the client decoder intact (SPEC X2)."""

from __future__ import annotations

import logging
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_platform.errors import (
    FieldViolation,
    QuotaViolation,
    RichError,
    bad_field,
    decode,
    invalid_argument,
)
from turnstile_platform.server import GrpcService
from turnstile_testing.probe import add_probe, call, settings


async def test_rich_error_round_trips_reason_metadata_and_retry_delay() -> None:
    async def refuse(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        raise RichError(
            code=grpc.StatusCode.RESOURCE_EXHAUSTED,
            message="cap reached for acme",
            reason="CAP_EXCEEDED",
            metadata={"key": "acme", "limit": "10", "current": "10"},
            retry_after_s=2.5,
            quota_violations=(QuotaViolation("acme", "10 of 10 live sandboxes"),),
        )

    app = GrpcService("probe", settings(), service_names=[])
    add_probe(app, {"Refuse": refuse})
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(channel, "Refuse")
        error = decode(caught.value)
    finally:
        await app.stop()

    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.message == "cap reached for acme"
    assert error.reason == "CAP_EXCEEDED"
    assert error.domain == "turnstile.dev"
    assert error.metadata == {"key": "acme", "limit": "10", "current": "10"}
    assert error.retry_after_s == pytest.approx(2.5)
    assert error.quota_violations == (QuotaViolation("acme", "10 of 10 live sandboxes"),)


async def test_invalid_argument_names_every_bad_field() -> None:
    async def reject(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        raise invalid_argument(
            FieldViolation("sandbox_id", "must not be empty"),
            FieldViolation("client.client_id", "must be at most 253 characters"),
        )

    app = GrpcService("probe", settings(), service_names=[])
    add_probe(app, {"Reject": reject})
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(channel, "Reject")
    finally:
        await app.stop()

    error = decode(caught.value)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert error.reason == "INVALID_FIELD"
    assert error.metadata["field"] == "sandbox_id"
    assert [v.field for v in error.field_violations] == ["sandbox_id", "client.client_id"]
    assert "sandbox_id: must not be empty" in error.message
    assert not error.retryable


async def test_unexpected_exception_becomes_internal_without_leaking_details() -> None:
    async def crash(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        raise KeyError("secret-internal-state")

    app = GrpcService("probe", settings(), service_names=[])
    add_probe(app, {"Crash": crash})
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await call(channel, "Crash")
    finally:
        await app.stop()
    assert caught.value.code() == grpc.StatusCode.INTERNAL
    assert "secret" not in (caught.value.details() or "")


def test_decoding_an_error_without_details_keeps_code_and_message() -> None:
    class Plain(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.DEADLINE_EXCEEDED

        def details(self) -> str:
            return "deadline"

    error = decode(Plain())
    assert (error.code, error.message, error.reason) == (
        grpc.StatusCode.DEADLINE_EXCEEDED,
        "deadline",
        "",
    )
    assert bad_field("x", "y").field_violations == (FieldViolation("x", "y"),)


async def test_every_rpc_is_counted_by_its_status_code() -> None:
    from prometheus_client import REGISTRY

    labels = {"grpc_service": "test.Probe", "grpc_method": "Flaky", "grpc_code": "UNAVAILABLE"}
    before = REGISTRY.get_sample_value("turnstile_grpc_server_handled_total", labels) or 0.0

    async def flaky(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        raise RichError(code=grpc.StatusCode.UNAVAILABLE, message="try later", retry_after_s=1)

    app = GrpcService("probe", settings(), service_names=[])
    add_probe(app, {"Flaky": flaky})
    port = await app.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            for _ in range(3):
                with pytest.raises(grpc.aio.AioRpcError):
                    await call(channel, "Flaky")
    finally:
        await app.stop()
    after = REGISTRY.get_sample_value("turnstile_grpc_server_handled_total", labels)
    assert after == before + 3


def test_a_status_echoing_a_10kb_field_stays_small_enough_to_arrive() -> None:
    # Unbounded, a 10 KB value in the message and details exceeds gRPC's metadata
    # limit and the caller sees RESOURCE_EXHAUSTED instead of this error.
    huge = "x" * 10_240
    error = bad_field("tier", f"{huge!r} is not a declared tier")
    status = error.to_status()
    assert sum(len(v) for _, v in status.trailing_metadata) < 4096
    assert status.code is grpc.StatusCode.INVALID_ARGUMENT


class _BrokenError(Exception):
    """An error only this test's handler raises (the log throttle is keyed by type)."""


async def test_repeated_unexpected_errors_are_counted_not_each_logged_with_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """100 calls failing alike: one ERROR line with its traceback, the rest counted
    (the next line of the same method and error type says how many), SPEC O6."""

    async def crash(_: bytes, __: grpc.aio.ServicerContext[Any, Any]) -> bytes:
        raise _BrokenError("bad cursor")

    app = GrpcService("probe", settings(), service_names=[])
    add_probe(app, {"CrashOften": crash})
    port = await app.start()
    try:
        with caplog.at_level(logging.ERROR, logger="turnstile_platform.interceptors"):
            async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
                for _ in range(100):
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await call(channel, "CrashOften")
                    assert caught.value.code() == grpc.StatusCode.INTERNAL
    finally:
        await app.stop()
    lines = [r for r in caplog.records if r.getMessage().startswith("unhandled error")]
    assert len(lines) == 1
    assert lines[0].exc_info is not None
    assert lines[0].__dict__["error_type"] == "_BrokenError"
