"""Bounded calls (SPEC F3): a paused Redis costs a call its budget and no more,
repeated failures open the breaker (calls then fail at once), and a probe after
the server returns closes it."""

from __future__ import annotations

import asyncio
import time

import pytest
from redis.exceptions import ResponseError

from turnstile_platform.bounded import BreakerState
from turnstile_platform.redis_client import (
    UNREACHABLE,
    RedisBreakerOpenError,
    RedisBudgetExceededError,
    create_redis,
    redis_guard,
)
from turnstile_testing.processes import RedisProcess

BUDGET_S = 0.3
#: Slack for a loaded 2-core machine; the bound measured is reported, not this.
MARGIN_S = 0.7


async def _elapsed(call: object) -> tuple[float, BaseException | None]:
    started = time.perf_counter()
    try:
        await call  # type: ignore[misc]
    except Exception as error:
        return time.perf_counter() - started, error
    return time.perf_counter() - started, None


async def test_a_paused_redis_costs_a_command_its_budget_then_the_breaker_answers_at_once(
    private_redis: RedisProcess,
) -> None:
    client = create_redis(
        private_redis.url, timeout_s=BUDGET_S, guard=redis_guard(BUDGET_S, failures=2, open_s=60)
    )
    try:
        assert await client.set("k", "v")
        private_redis.pause()
        for _ in range(2):
            seconds, error = await _elapsed(client.get("k"))
            assert isinstance(error, RedisBudgetExceededError)
            assert isinstance(error, UNREACHABLE)
            assert seconds < BUDGET_S + MARGIN_S
        assert client.guard is not None
        assert client.guard.breaker.state is BreakerState.OPEN
        seconds, error = await _elapsed(client.get("k"))
        assert isinstance(error, RedisBreakerOpenError)
        assert isinstance(error, UNREACHABLE)
        assert seconds < BUDGET_S
    finally:
        private_redis.resume()
        await client.aclose()


async def test_scripts_and_pipelines_are_bounded_too(private_redis: RedisProcess) -> None:
    client = create_redis(private_redis.url, timeout_s=BUDGET_S)
    script = client.register_script("return redis.call('INCR', KEYS[1])")
    try:
        assert await script(keys=["n"]) == 1
        private_redis.pause()
        seconds, error = await _elapsed(script(keys=["n"]))
        assert isinstance(error, RedisBudgetExceededError)
        assert seconds < BUDGET_S + MARGIN_S
        pipe = client.pipeline(transaction=True)
        pipe.incr("n")
        pipe.incr("n")
        seconds, error = await _elapsed(pipe.execute())
        assert isinstance(error, RedisBudgetExceededError)
        assert seconds < BUDGET_S + MARGIN_S
    finally:
        private_redis.resume()
        await client.aclose()


async def test_many_calls_at_once_on_a_paused_redis_each_end_within_the_budget(
    private_redis: RedisProcess,
) -> None:
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, max_connections=8)
    try:
        await client.ping()
        private_redis.pause()
        results = await asyncio.gather(*(_elapsed(client.get(f"k{i}")) for i in range(32)))
        for seconds, error in results:
            assert isinstance(error, UNREACHABLE)
            assert seconds < BUDGET_S + MARGIN_S
    finally:
        private_redis.resume()
        await client.aclose()


async def test_after_redis_resumes_one_probe_closes_the_breaker(
    private_redis: RedisProcess,
) -> None:
    guard = redis_guard(BUDGET_S, failures=1, open_s=0.05)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    try:
        await client.ping()
        private_redis.pause()
        with pytest.raises(RedisBudgetExceededError):
            await client.get("k")
        assert guard.breaker.state is not BreakerState.CLOSED
        private_redis.resume()
        async with asyncio.timeout(10):
            while True:
                try:
                    assert await client.set("k", "back")
                    break
                except RedisBreakerOpenError:
                    await asyncio.sleep(0.05)
        assert guard.breaker.state.name == "CLOSED"  # narrowed above; read again
        assert await client.get("k") == b"back"
    finally:
        private_redis.resume()
        await client.aclose()


async def test_a_script_error_is_an_answer_not_a_failure(private_redis: RedisProcess) -> None:
    guard = redis_guard(BUDGET_S, failures=1, open_s=60)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    try:
        bad = client.register_script("return redis.call('NOPE')")
        with pytest.raises(ResponseError):
            await bad()
        assert guard.breaker.state is BreakerState.CLOSED
    finally:
        await client.aclose()


async def test_a_call_queued_here_while_redis_answers_others_does_not_open_the_breaker(
    private_redis: RedisProcess,
) -> None:
    """Time a call spends waiting on this process (a semaphore, the pool, the event
    loop) is our overload: it fails the call, not Redis's breaker."""
    guard = redis_guard(BUDGET_S, failures=1, open_s=60)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    local_queue = asyncio.Lock()
    entered = asyncio.Event()

    async def queued_behind_local_work() -> None:
        async with guard.call():
            entered.set()
            async with local_queue:
                await client.get("k")

    try:
        async with local_queue:
            task = asyncio.create_task(queued_behind_local_work())
            await entered.wait()
            assert await client.ping()  # Redis answers meanwhile
            with pytest.raises(RedisBudgetExceededError):
                await task
        assert guard.breaker.state is BreakerState.CLOSED
        assert await client.set("k", "v")
    finally:
        await client.aclose()


async def test_a_stalled_event_loop_does_not_open_the_breaker_but_a_paused_redis_does(
    private_redis: RedisProcess,
) -> None:
    """An expiry that fires a whole budget late means the loop was stalled and the
    call never had its budget; the next call, on time against the paused server,
    is a real failure and opens the breaker."""
    guard = redis_guard(BUDGET_S, failures=1, open_s=60)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    try:
        await client.ping()
        private_redis.pause()
        # Runs once the call below is in flight: blocks the loop past its deadline.
        asyncio.get_running_loop().call_soon(time.sleep, BUDGET_S * 3)
        with pytest.raises(RedisBudgetExceededError):
            await client.get("k")
        assert guard.breaker.state is BreakerState.CLOSED
        with pytest.raises(RedisBudgetExceededError):
            await client.get("k")
        assert guard.breaker.state.name == "OPEN"  # narrowed above; read again
    finally:
        private_redis.resume()
        await client.aclose()
