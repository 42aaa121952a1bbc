"""Undecodable request bytes: INVALID_ARGUMENT naming ``request`` on every kind of
method, one bounded warning rather than a traceback per call; reflection answers
under ``grpc.reflection.v1`` as well as ``v1alpha``."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2
from grpc_reflection.v1alpha import reflection_pb2

from turnstile_platform import decoding
from turnstile_platform.errors import decode
from turnstile_platform.log_throttle import LogThrottle
from turnstile_platform.server import GrpcService
from turnstile_testing.probe import settings

GARBAGE = b"\xff\xff\xff\xff\x0f"


@pytest.fixture
async def app() -> AsyncIterator[GrpcService]:
    service = GrpcService("test", settings(), service_names=[])
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


@pytest.fixture
async def channel(app: GrpcService) -> AsyncIterator[grpc.aio.Channel]:
    async with grpc.aio.insecure_channel(app.address) as opened:
        yield opened


async def _code(call: Any) -> tuple[grpc.StatusCode, Any]:
    try:
        if hasattr(call, "__aiter__"):
            async for _ in call:
                pass
        else:
            await call
    except grpc.aio.AioRpcError as error:
        return error.code(), decode(error)
    return grpc.StatusCode.OK, None


async def test_undecodable_unary_request_is_invalid_argument_naming_the_request(
    channel: grpc.aio.Channel,
) -> None:
    check = channel.unary_unary("/grpc.health.v1.Health/Check", None, None)
    code, error = await _code(check(GARBAGE, timeout=10))
    assert code is grpc.StatusCode.INVALID_ARGUMENT
    assert error.field_violations[0].field == "request"
    assert "grpc.health.v1.HealthCheckRequest" in error.message


async def test_undecodable_server_stream_request_is_invalid_argument(
    channel: grpc.aio.Channel,
) -> None:
    watch = channel.unary_stream("/grpc.health.v1.Health/Watch", None, None)
    code, _ = await _code(watch(GARBAGE, timeout=10))
    assert code is grpc.StatusCode.INVALID_ARGUMENT


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_undecodable_message_in_a_request_stream_is_invalid_argument(
    channel: grpc.aio.Channel, version: str
) -> None:
    info = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo", None, None
    )
    code, _ = await _code(info(iter([GARBAGE]), timeout=10))
    assert code is grpc.StatusCode.INVALID_ARGUMENT


async def test_undecodable_calls_log_one_short_warning_per_method_and_no_traceback(
    channel: grpc.aio.Channel, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    fresh = LogThrottle(decoding.log, interval_s=decoding.WARN_INTERVAL_S)
    monkeypatch.setattr(decoding, "warnings", fresh)  # lines other tests wrote do not count
    check = channel.unary_unary("/grpc.health.v1.Health/Check", None, None)
    with caplog.at_level(logging.INFO):
        for _ in range(5):
            code, _ = await _code(check(GARBAGE, timeout=10))
            assert code is grpc.StatusCode.INVALID_ARGUMENT
    warnings = [r for r in caplog.records if r.name == decoding.__name__]
    assert len(warnings) == 1
    assert warnings[0].levelno == logging.WARNING
    assert warnings[0].exc_info is None
    assert not [r for r in caplog.records if r.exc_info is not None]


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
async def test_reflection_lists_services_under_both_versions(
    channel: grpc.aio.Channel, version: str
) -> None:
    info = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    answers = [
        answer
        async for answer in info(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
        )
    ]
    names = {s.name for s in answers[0].list_services_response.service}
    assert {
        "grpc.health.v1.Health",
        "grpc.reflection.v1.ServerReflection",
        "grpc.reflection.v1alpha.ServerReflection",
    } <= names


async def test_the_v1_reflection_service_describes_itself(channel: grpc.aio.Channel) -> None:
    info = channel.stream_stream(
        "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    request = reflection_pb2.ServerReflectionRequest(
        file_containing_symbol="grpc.reflection.v1.ServerReflection"
    )
    answers = [answer async for answer in info(iter([request]), timeout=10)]
    assert answers[0].file_descriptor_response.file_descriptor_proto


async def test_health_list_answers_every_status(channel: grpc.aio.Channel) -> None:
    listing = channel.unary_unary(
        "/grpc.health.v1.Health/List",
        request_serializer=health_pb2.HealthListRequest.SerializeToString,
        response_deserializer=health_pb2.HealthListResponse.FromString,
    )
    answer = await listing(health_pb2.HealthListRequest(), timeout=10)
    assert "" in answer.statuses
