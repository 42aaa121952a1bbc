"""Bounded calls (SPEC F3): a paused Redis costs a call its budget and no more,
repeated failures open the breaker (calls then fail at once), and a probe after
the server returns closes it. A call held up by this process's own overload
(Redis answering others, the event loop stalled, every connection in use) waits
on for its answer instead of failing, up to the overload wait."""

from __future__ import annotations

import asyncio
import contextlib
import time

import pytest
from prometheus_client import REGISTRY
from redis.exceptions import ResponseError

from turnstile_platform.bounded import BreakerOpenError, BreakerState, BudgetExceededError
from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable
from turnstile_platform.redis_client import (
    AnyRedis,
    BoundedRedis,
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
            assert isinstance(error, BudgetExceededError)
            assert isinstance(error, DependencyUnavailable)
            assert seconds < BUDGET_S + MARGIN_S
        assert client.guard is not None
        assert client.guard.breaker.state is BreakerState.OPEN
        seconds, error = await _elapsed(client.get("k"))
        assert isinstance(error, BreakerOpenError)
        assert isinstance(error, DependencyUnavailable)
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
        assert isinstance(error, BudgetExceededError)
        assert seconds < BUDGET_S + MARGIN_S
        pipe = client.pipeline(transaction=True)
        pipe.incr("n")
        pipe.incr("n")
        seconds, error = await _elapsed(pipe.execute())
        assert isinstance(error, BudgetExceededError)
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
            assert isinstance(error, DependencyUnavailable)
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
        with pytest.raises(BudgetExceededError):
            await client.get("k")
        assert guard.breaker.state is not BreakerState.CLOSED
        private_redis.resume()
        async with asyncio.timeout(10):
            while True:
                try:
                    assert await client.set("k", "back")
                    break
                except BreakerOpenError:
                    await asyncio.sleep(0.05)
        assert guard.breaker.state.name == "CLOSED"  # narrowed above; read again
        assert await client.get("k") == b"back"
    finally:
        private_redis.resume()
        await client.aclose()


async def test_a_refused_connection_counts_toward_the_breaker(
    private_redis: RedisProcess,
) -> None:
    """A stopped Redis (connections refused at once) fails each call as unreachable
    and counts toward the breaker, which then refuses without trying."""
    guard = redis_guard(BUDGET_S, failures=2, open_s=60)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    try:
        assert await client.set("k", "v")
        private_redis.stop()
        for _ in range(2):
            _, error = await _elapsed(client.get("k"))
            assert isinstance(error, DependencyUnavailable)
            assert not isinstance(error, (BudgetExceededError, BreakerOpenError))
        assert guard.breaker.state is BreakerState.OPEN
        _, error = await _elapsed(client.get("k"))
        assert isinstance(error, BreakerOpenError)
    finally:
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


async def _answering(client: AnyRedis, stop: asyncio.Event) -> None:
    """Other traffic Redis keeps answering: a PING every quarter budget."""
    while not stop.is_set():
        assert await client.ping()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), BUDGET_S / 4)


def _overload_waits() -> float:
    return (
        REGISTRY.get_sample_value(
            "turnstile_dependency_overload_waits_total", {"dependency": "redis"}
        )
        or 0.0
    )


def _calls(result: str) -> float:
    return (
        REGISTRY.get_sample_value(
            "turnstile_dependency_calls_total", {"dependency": "redis", "result": result}
        )
        or 0.0
    )


async def test_a_call_queued_here_while_redis_answers_others_waits_on_and_gets_its_answer(
    private_redis: RedisProcess,
) -> None:
    """Time a call spends waiting on this process (a lock, the pool, the event
    loop) while Redis answers others is our overload: the call outlives its
    budget instead of failing, and the breaker does not hear of it."""
    guard = redis_guard(BUDGET_S, failures=1, open_s=60)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    local_queue = asyncio.Lock()
    entered = asyncio.Event()
    stop = asyncio.Event()

    async def queued_behind_local_work() -> object:
        async with guard.call():
            entered.set()
            async with local_queue:
                return await client.get("k")

    others = asyncio.create_task(asyncio.sleep(0))
    try:
        await client.set("k", "v")
        waits = _overload_waits()
        async with local_queue:
            task = asyncio.create_task(queued_behind_local_work())
            await entered.wait()
            others = asyncio.create_task(_answering(client, stop))
            started = time.perf_counter()
            # Held here three budgets; every one of them sees Redis answer others.
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(task), BUDGET_S * 3)
            assert not task.done()
        assert await task == b"v"
        assert time.perf_counter() - started >= BUDGET_S * 3
        assert guard.breaker.state is BreakerState.CLOSED
        assert _overload_waits() == waits + 1
    finally:
        stop.set()
        await others
        await client.aclose()


async def test_a_call_held_up_here_past_the_overload_wait_fails_as_overloaded_uncounted(
    private_redis: RedisProcess,
) -> None:
    """The wait on our own overload is bounded too: past it the call fails as
    overloaded (still a retryable "unreachable" to generic handlers), and the
    breaker stays closed because Redis answered all along."""
    guard = redis_guard(BUDGET_S, failures=1, open_s=60, overload_wait_s=BUDGET_S * 3)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    never = asyncio.Lock()
    stop = asyncio.Event()

    async def stuck_here() -> None:
        async with guard.call(), never:
            await client.get("k")

    others = asyncio.create_task(_answering(client, stop))
    try:
        async with never:
            seconds, error = await _elapsed(stuck_here())
        assert isinstance(error, DependencyOverloaded)
        # Never an "unavailable": a handler that fails open on one cannot catch it.
        assert not isinstance(error, (DependencyUnavailable, OSError))
        assert BUDGET_S * 3 <= seconds < BUDGET_S * 4 + MARGIN_S
        assert guard.breaker.state is BreakerState.CLOSED
    finally:
        stop.set()
        await others
        await client.aclose()


async def test_a_stalled_event_loop_does_not_fail_a_call_redis_answered(
    private_redis: RedisProcess,
) -> None:
    """A budget that ends while the loop is stalled was never the call's to spend:
    once the loop runs again the call takes the answer Redis gave long ago."""
    guard = redis_guard(BUDGET_S, failures=1, open_s=60)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    try:
        await client.set("k", "v")
        # Runs once the call below is in flight: blocks the loop past its budget.
        asyncio.get_running_loop().call_soon(time.sleep, BUDGET_S * 3)
        assert await client.get("k") == b"v"
        assert guard.breaker.state is BreakerState.CLOSED
    finally:
        await client.aclose()


@pytest.mark.redis_topologies("cluster")
async def test_a_stall_over_most_of_a_budget_does_not_fail_calls_redis_answered(
    redis_url: str, redis_prefix: str
) -> None:
    """A stall that began as the calls started and ended shortly after their budgets
    (their expiry less than a whole budget late) left them almost none of it:
    their commands went out after it, and the answers Redis gave at once were not
    read before the budgets were judged. Not a silent Redis: the calls wait on
    and get their answers. On a Cluster a call's signs of life are its master's
    alone, and no master here serves anything but these few calls."""
    guard = redis_guard(BUDGET_S, failures=1, open_s=60)
    client = create_redis(redis_url, timeout_s=BUDGET_S, guard=guard)
    # Keys of several slots: on a Cluster, of every master.
    keys = [f"{redis_prefix}{{{n}}}" for n in range(8)]
    try:
        for key in keys:
            await client.set(key, key)
        timeouts = _calls("timeout")

        async def get(key: str) -> object:
            return await client.get(key)

        calls = [asyncio.create_task(get(key)) for key in keys]
        # Runs after each call has armed its budget and before it sends (a
        # Cluster call sends from a task of its own, started after this).
        asyncio.get_running_loop().call_soon(time.sleep, BUDGET_S * 1.3)
        assert await asyncio.gather(*calls) == [key.encode() for key in keys]
        assert _calls("timeout") == timeouts
        assert guard.breaker.reported is BreakerState.CLOSED
    finally:
        for key in keys:
            await client.delete(key)
        await client.aclose()


async def test_after_a_stalled_loop_a_paused_redis_fails_the_call_one_budget_later(
    private_redis: RedisProcess,
) -> None:
    """The stall gives the call a fresh budget, not a pass: a paused server that
    answers nobody during it is a real failure, and opens the breaker."""
    guard = redis_guard(BUDGET_S, failures=1, open_s=60)
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=guard)
    try:
        await client.ping()
        private_redis.pause()
        asyncio.get_running_loop().call_soon(time.sleep, BUDGET_S * 3)
        seconds, error = await _elapsed(client.get("k"))
        assert isinstance(error, BudgetExceededError)
        assert not isinstance(error, DependencyOverloaded)
        assert seconds < BUDGET_S * 4 + MARGIN_S
        assert guard.breaker.state is BreakerState.OPEN
    finally:
        private_redis.resume()
        await client.aclose()


async def test_more_calls_than_connections_wait_their_turn_instead_of_failing(
    private_redis: RedisProcess,
) -> None:
    """redis-py's pool raises "Too many connections" at once; a caller would read
    it as Redis unreachable (and a fail-open cap admit). Here calls queue for a
    connection, and the pool never opens more than its maximum."""
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, max_connections=4)
    assert isinstance(client, BoundedRedis)  # one server: one pool
    pool = client.connection_pool
    opened: set[int] = set()
    script = client.register_script("return redis.call('INCR', KEYS[1])")

    async def one() -> int:
        value = int(await script(keys=["n"]))
        opened.update(id(c) for c in pool._in_use_connections)
        return value

    try:
        values = await asyncio.gather(*(one() for _ in range(200)))
        assert sorted(values) == list(range(1, 201))
        assert len(opened) <= 4
        assert len(pool._available_connections) <= 4
    finally:
        await client.aclose()


async def test_a_cut_off_leaves_the_task_uncancelled_and_a_callers_cancellation_stays_one(
    private_redis: RedisProcess,
) -> None:
    """The guard's watch cuts a call off by cancelling its task (its only timer, no
    asyncio.timeout beside it): the call fails as budget exceeded and the task is
    left with no cancellation pending, so what the task awaits next is not cut
    short; a cancellation by the call's own caller still arrives as one."""
    client = create_redis(private_redis.url, timeout_s=BUDGET_S, guard=redis_guard(BUDGET_S))
    try:
        private_redis.pause()
        _, error = await _elapsed(client.get("k"))
        assert isinstance(error, BudgetExceededError)
        task = asyncio.current_task()
        assert task is not None
        assert task.cancelling() == 0
        await asyncio.sleep(0)  # nothing pending: this is not cancelled

        call = asyncio.ensure_future(client.get("k"))
        await asyncio.sleep(BUDGET_S / 3)  # the call waits on the paused server
        call.cancel()
        with pytest.raises(asyncio.CancelledError):
            await call
    finally:
        private_redis.resume()
        await client.aclose()
