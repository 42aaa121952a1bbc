"""One contract for a failing dependency: what the clients raise past their guard,
and how the platform interceptor answers it, once, for every service."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
from prometheus_client import REGISTRY
from redis.credentials import CredentialProvider

from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable
from turnstile_platform.errors import decode
from turnstile_platform.postgres import create_pool, postgres_guard
from turnstile_platform.redis_client import create_redis
from turnstile_platform.server import GrpcService
from turnstile_platform.settings import ServiceSettings
from turnstile_testing.processes import free_port

Context = grpc.aio.ServicerContext[Any, Any]
RETRY_AFTER_S = 2.5


class PasswordFile(CredentialProvider):
    """Reads the Redis password from a file on every connect, as a mounted secret."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def get_credentials(self) -> tuple[str]:
        return (self.path.read_text().strip(),)


async def test_a_bare_oserror_inside_a_redis_call_surfaces_as_dependency_unavailable(
    redis_url: str, tmp_path: Path
) -> None:
    """redis-py lets an ``OSError`` from a connection's set-up out unwrapped (here a
    password file that is gone): past the guard it is ``DependencyUnavailable``,
    never a bare ``OSError`` a handler could catch to fail open."""
    if not redis_url.startswith("redis://"):
        pytest.skip("one server: the credential provider is a connection option")
    client = create_redis(
        redis_url, timeout_s=0.5, credential_provider=PasswordFile(tmp_path / "gone")
    )
    try:
        with pytest.raises(DependencyUnavailable) as raised:
            await client.get("k")
        assert not isinstance(raised.value, OSError)
        assert raised.value.dependency == "redis"
        assert isinstance(raised.value.__cause__, FileNotFoundError)
    finally:
        await client.aclose()


async def test_a_refused_redis_and_a_refused_postgresql_are_dependency_unavailable() -> None:
    """Nothing listens: the library's connection errors never reach the caller."""
    port = free_port()
    client = create_redis(f"redis://127.0.0.1:{port}/0", timeout_s=0.5)
    try:
        with pytest.raises(DependencyUnavailable) as raised:
            await client.get("k")
        assert raised.value.dependency == "redis"
    finally:
        await client.aclose()
    with pytest.raises(DependencyUnavailable) as refused:
        await create_pool(
            f"postgresql://postgres@127.0.0.1:{port}/postgres",
            guard=postgres_guard(0.5),
            min_size=1,
            max_size=1,
            application_name="dependencies-test",
        )
    assert refused.value.dependency == "postgresql"


class Failing:
    """A server whose methods fail as a dependency would: ``Redis`` through a real
    client of a Redis nobody serves, ``Overloaded`` and ``Stream`` as raised."""

    def __init__(self) -> None:
        settings = ServiceSettings(port=0, retry_after_s=RETRY_AFTER_S, log_format="text")
        self.app = GrpcService("dependencies-test", settings, service_names=["test.Deps"])
        self.redis = create_redis(f"redis://127.0.0.1:{free_port()}/0", timeout_s=0.5)
        handler = grpc.method_handlers_generic_handler(
            "test.Deps",
            {
                "Redis": grpc.unary_unary_rpc_method_handler(self._redis),
                "Overloaded": grpc.unary_unary_rpc_method_handler(self._overloaded),
                "Stream": grpc.unary_stream_rpc_method_handler(self._stream),
            },
        )
        self.app.server.add_generic_rpc_handlers((handler,))

    async def _redis(self, request: bytes, context: Context) -> bytes:
        value = await self.redis.get("k")
        return value if isinstance(value, bytes) else b""

    async def _overloaded(self, request: bytes, context: Context) -> bytes:
        raise DependencyOverloaded("redis", "held up here past the overload wait")

    async def _stream(self, request: bytes, context: Context) -> AsyncIterator[bytes]:
        yield b"first"
        raise DependencyUnavailable("postgresql", "postgresql at 10.0.0.7:5432 refused")


@pytest.fixture
async def failing() -> AsyncIterator[tuple[Failing, Any]]:
    server = Failing()
    await server.app.start()
    channel: Any = grpc.aio.insecure_channel(f"127.0.0.1:{server.app.port}")
    yield server, channel
    await channel.close(None)
    await server.redis.aclose()
    await server.app.stop()


def _refusals(method: str, dependency: str, reason: str) -> float:
    value = REGISTRY.get_sample_value(
        "turnstile_grpc_server_dependency_refusals_total",
        {
            "grpc_service": "test.Deps",
            "grpc_method": method,
            "dependency": dependency,
            "reason": reason,
        },
    )
    return value or 0.0


async def test_the_interceptor_answers_an_unavailable_dependency_once_with_the_settings_hint(
    failing: tuple[Failing, Any],
) -> None:
    _, channel = failing
    before = _refusals("Redis", "redis", "DEPENDENCY_UNAVAILABLE")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await channel.unary_unary("/test.Deps/Redis")(b"")
    rich = decode(raised.value)
    assert rich.code == grpc.StatusCode.UNAVAILABLE
    assert rich.reason == "DEPENDENCY_UNAVAILABLE"
    assert rich.metadata == {"dependency": "redis"}
    assert rich.retry_after_s == RETRY_AFTER_S
    assert "127.0.0.1" not in rich.message  # no host or library error leaks
    assert _refusals("Redis", "redis", "DEPENDENCY_UNAVAILABLE") == before + 1


async def test_the_interceptor_answers_an_overload_as_replica_overloaded_never_a_fail_mode(
    failing: tuple[Failing, Any],
) -> None:
    _, channel = failing
    before = _refusals("Overloaded", "redis", "REPLICA_OVERLOADED")
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await channel.unary_unary("/test.Deps/Overloaded")(b"")
    rich = decode(raised.value)
    assert rich.code == grpc.StatusCode.UNAVAILABLE
    assert rich.reason == "REPLICA_OVERLOADED"
    assert rich.metadata == {"dependency": "redis"}
    assert rich.retry_after_s == RETRY_AFTER_S
    assert _refusals("Overloaded", "redis", "REPLICA_OVERLOADED") == before + 1


async def test_a_stream_that_meets_a_failing_dependency_ends_with_the_same_answer(
    failing: tuple[Failing, Any],
) -> None:
    _, channel = failing
    call = channel.unary_stream("/test.Deps/Stream")(b"")
    assert await call.read() == b"first"
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    rich = decode(raised.value)
    assert rich.code == grpc.StatusCode.UNAVAILABLE
    assert rich.reason == "DEPENDENCY_UNAVAILABLE"
    assert rich.metadata == {"dependency": "postgresql"}
    assert rich.retry_after_s == RETRY_AFTER_S
    assert "10.0.0.7" not in rich.message
