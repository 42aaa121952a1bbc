"""A hung Redis under affinity (SPEC F3): with Redis paused, ``Place``,
``ReleaseLease`` and a new worker's ``Attach`` answer UNAVAILABLE with a retry
hint within the Redis budget, at once once the breaker is open, and placement
works again after a resume."""

from __future__ import annotations

import time
from collections.abc import Awaitable
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio

from turnstile_contracts import affinity_pb2
from turnstile_platform import health_check
from turnstile_platform.errors import decode
from turnstile_testing.processes import RedisProcess

if TYPE_CHECKING:
    from conftest import Credentials, StartAffinity, StartWorker

BUDGET_S = 0.25
#: Slack for a loaded 2-core machine on top of the budget.
MARGIN_S = 0.5


async def unavailable_within_budget(call: Awaitable[Any]) -> float:
    started = time.perf_counter()
    try:
        answer = await call
    except grpc.aio.AioRpcError as error:
        elapsed = time.perf_counter() - started
        rich = decode(error)
        assert rich.code == grpc.StatusCode.UNAVAILABLE
        assert rich.reason == "DEPENDENCY_UNAVAILABLE"
        assert rich.retryable
        return elapsed
    raise AssertionError(f"expected UNAVAILABLE, got {answer}")


async def test_place_and_release_answer_within_the_budget_while_redis_is_paused(
    affinity: StartAffinity,
    worker: StartWorker,
    credentials: Credentials,
    private_redis: RedisProcess,
) -> None:
    service = await affinity(
        tiers="a",
        redis_url=private_redis.url,
        redis_timeout_s=BUDGET_S,
        breaker_failures=3,
        health_check_interval_s=0.1,
    )
    await worker(service.address, "a1", "a", capacity=4)
    placed = await service.place("chat-0", "a")
    a2 = await credentials.issue("a2")
    release = affinity_pb2.ReleaseLeaseRequest(
        sandbox_id=placed.sandbox_id, lease_id=placed.lease_id
    )

    private_redis.pause()
    try:
        seconds = []
        for i in range(6):  # three spend the budget, then the breaker answers at once
            place = service.stub.Place(
                affinity_pb2.PlaceRequest(client_id="acme", session_id=f"chat-{i + 1}", tier="a"),
                timeout=10,
            )
            seconds.append(await unavailable_within_budget(place))
        seconds.append(
            await unavailable_within_budget(service.stub.ReleaseLease(release, timeout=10))
        )
        hello = affinity_pb2.AttachRequest(
            hello=affinity_pb2.Hello(
                sandbox_id="a2",
                labels={"turnstile.dev/tier": "a"},
                capacity=1,
                credential=a2.credential,
            )
        )
        stream = service.stub.Attach(iter([hello]), timeout=10)
        seconds.append(await unavailable_within_budget(stream.read()))
        print(f"\nPlace/ReleaseLease on a paused Redis: {[round(s * 1000) for s in seconds]} ms")
        assert max(seconds) < BUDGET_S + MARGIN_S
        assert await health_check.check(service.address) == "NOT_SERVING"
    finally:
        private_redis.resume()

    assert await health_check.wait_serving(service.address, timeout_s=10)
    again = await service.place("chat-0", "a")
    assert again.sandbox_id == "a1"
