"""The fair queue through the real Admit gRPC path, on real Redis with real
concurrency (SPEC Q1): waiters are admitted as the cluster bucket refills, never
past it, each once, FIFO within a key and fairly across keys; a waiter that
gives up or whose replica died leaves nothing behind."""

from __future__ import annotations

import asyncio
import math
from collections import Counter
from functools import partial
from typing import Any

import grpc
import pytest
import redis.asyncio as aioredis
from google.protobuf.duration_pb2 import Duration
from prometheus_client import REGISTRY

from turnstile_admission import metrics
from turnstile_admission.redis_store import AdmissionStore
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys.limits import ClusterLimits, LimitsStore
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_testing.eventually import eventually

ADMITTED = admission_pb2.DECISION_ADMITTED
REFUSED = admission_pb2.DECISION_REFUSED
CLIENTS = ("heavy", "l1", "l2", "l3", "l4", "acme")
RATE = 20.0


def settings(rate: float = RATE) -> dict[str, Any]:
    return {
        "client_allowlist": CLIENTS,
        "rpc_timeout_s": 60,
        "rate": {
            "cluster_rate_per_s": rate,
            "cluster_burst": 1,
            "default_rate_per_s": 1000,
            "default_burst": 1000,
        },
        "concurrency": {"default_limit": 10_000},
        "cap": {"default_cap": 10_000},
        "queue": {"tick_interval_s": 0.01},
    }


def warm(sandbox_id: str, client_id: str, wait_s: float = 0.0) -> admission_pb2.AdmitRequest:
    request = admission_pb2.AdmitRequest(
        sandbox_id=sandbox_id,
        client=common_pb2.ActivationClient(client_id=client_id),
        kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
    )
    if wait_s:
        request.wait_budget.CopyFrom(Duration(seconds=int(wait_s), nanos=int(wait_s % 1 * 1e9)))
    return request


async def waiters(redis: aioredis.Redis, prefix: str) -> int:
    return int(await redis.hlen(f"{prefix}{{adm}}:q:info"))


async def queue_is_empty(redis: aioredis.Redis, prefix: str) -> bool:
    keys = [k async for k in redis.scan_iter(match=f"{prefix}{{adm}}:q:*")]
    held = [k for k in keys if not k.endswith((b"q:meta", b"q:vf", b"q:owners", b"q:pace"))]
    holds = [k async for k in redis.scan_iter(match=f"{prefix}{{adm}}:hold:*")]
    return not held and not holds


@pytest.mark.redis_topologies("single", "cluster")
async def test_waiters_are_admitted_as_the_bucket_refills_never_past_it(
    start_admission: Any,
) -> None:
    running = await start_admission(**settings())
    grants_before = (
        REGISTRY.get_sample_value("turnstile_admission_queue_grants_total", {"key": "acme"}) or 0
    )
    loop = asyncio.get_running_loop()
    started = loop.time()
    done: list[float] = []

    async def admit(n: int) -> Any:
        answer = await running.stub.Admit(warm(f"sb-{n}", "acme", 10), timeout=15)
        done.append(loop.time() - started)
        return answer

    answers = await asyncio.gather(*(admit(n) for n in range(30)))
    assert all(a.decision == ADMITTED for a in answers), {a.message for a in answers}
    assert len({a.hold_id for a in answers}) == 30  # no waiter granted twice
    # Burst 1 then 20 per second: by time t at most 1 + 20 t admitted (a 50 ms
    # allowance for the clock of this process against Redis's).
    for n, t in enumerate(sorted(done)):
        assert n + 1 <= 1 + RATE * (t + 0.05), (n, t)
    waited = [a for a in answers if a.HasField("waited")]
    assert REGISTRY.get_sample_value(
        "turnstile_admission_queue_grants_total", {"key": "acme"}
    ) == grants_before + len(waited)
    # Most of them waited; on a loaded machine the calls arrive spread out, and one
    # that arrives as a token refills, with no one waiting, takes it at once.
    assert len(waited) >= 15, len(waited)
    assert all(a.queue_position >= 1 for a in waited)


async def test_fifo_within_a_key(start_admission: Any, redis: aioredis.Redis) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    limits = LimitsStore(redis, prefix)
    # The bucket refills once in 1000 s while they join, one after the other.
    await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    order: list[int] = []

    async def admit(n: int) -> None:
        answer = await running.stub.Admit(warm(f"sb-{n}", "acme", 20), timeout=30)
        assert answer.decision == ADMITTED, answer.message
        order.append(n)

    waiting_before, waits_before = _key_waiters("acme"), _key_waits("acme")
    tasks = []
    for n in range(8):
        tasks.append(asyncio.create_task(admit(n)))
        await eventually(partial(_at_least, redis, prefix, n + 1), what=f"waiter {n} queued")
    # The key's queue length and its waits, as a dashboard reads them.
    assert _key_waiters("acme") == waiting_before + 8
    await limits.set_cluster(ClusterLimits(rate=RATE, burst=1))
    await asyncio.gather(*tasks)
    assert order == list(range(8))
    assert _key_waiters("acme") == waiting_before
    assert _key_waits("acme") == waits_before + 8


def _key_waiters(key: str) -> float:
    value = REGISTRY.get_sample_value("turnstile_admission_queue_key_waiters", {"key": key})
    return value or 0.0


def _key_waits(key: str) -> float:
    name = "turnstile_admission_queue_key_wait_seconds_count"
    return REGISTRY.get_sample_value(name, {"key": key}) or 0.0


async def _at_least(redis: aioredis.Redis, prefix: str, count: int) -> bool:
    return await waiters(redis, prefix) >= count


async def test_a_heavy_key_does_not_starve_light_ones(start_admission: Any) -> None:
    running = await start_admission(**settings())
    loop = asyncio.get_running_loop()
    done: list[tuple[float, str]] = []

    async def admit(client: str, n: int) -> None:
        answer = await running.stub.Admit(warm(f"{client}-{n}", client, 30), timeout=40)
        assert answer.decision == ADMITTED, answer.message
        done.append((loop.time(), client))

    heavy = [admit("heavy", n) for n in range(40)]
    light = [admit(f"l{k}", n) for k in range(1, 5) for n in range(4)]
    await asyncio.gather(*heavy, *light)
    first = Counter(client for _, client in sorted(done)[:20])
    # Five keys waiting, equal weights: about 4 grants each in the first 20 (FIFO
    # by arrival would give the heavy key, asked first, nearly all of them). A light
    # call that reaches the queue late on a loaded machine costs its key a grant,
    # so the bounds leave one grant of room.
    for k in range(1, 5):
        assert first[f"l{k}"] >= 2, first
    assert first["heavy"] <= 12, first


async def test_a_call_whose_budget_ends_is_refused_and_leaves_nothing(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings(rate=0.001))
    prefix = running.settings.redis_prefix
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    await running.stub.CommitHold(
        admission_pb2.CommitHoldRequest(hold_id=(await _hold(redis, prefix)))
    )
    answer = await running.stub.Admit(warm("sb-late", "acme", 0.3), timeout=5)
    assert answer.decision == admission_pb2.DECISION_REFUSED
    assert answer.waited.ToMilliseconds() >= 250
    assert answer.queue_position == 1
    assert "fair queue" in answer.message
    assert await eventually(lambda: queue_is_empty(redis, prefix))


async def _hold(redis: aioredis.Redis, prefix: str) -> str:
    keys = [k async for k in redis.scan_iter(match=f"{prefix}{{adm}}:hold:*")]
    assert len(keys) == 1
    return str(keys[0].decode().rsplit(":", 1)[1])


async def test_the_callers_deadline_bounds_the_wait(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings(rate=0.001))
    prefix = running.settings.redis_prefix
    await running.stub.Admit(warm("sb-first", "acme"))
    # A budget of 30 s, a deadline of 0.5 s: the refusal comes before the deadline
    # (after it, the call would end in DEADLINE_EXCEEDED, not with an answer).
    answer = await running.stub.Admit(warm("sb-late", "acme", 30), timeout=0.5)
    assert answer.decision == admission_pb2.DECISION_REFUSED
    assert await eventually(lambda: _no_waiters(redis, prefix))


async def _no_waiters(redis: aioredis.Redis, prefix: str) -> bool:
    return await waiters(redis, prefix) == 0


async def test_a_cancelled_waiter_releases_everything(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings(rate=0.001))
    prefix = running.settings.redis_prefix
    first = await running.stub.Admit(warm("sb-first", "acme"))
    await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=first.hold_id))
    # The token is back, but a waiter that is queued first keeps it from outsiders.
    await LimitsStore(redis, prefix).set_cluster(ClusterLimits(rate=0.001, burst=1))
    await redis.hset(
        f"{prefix}{{adm}}:cluster-bucket", mapping={"t": 0, "ts": 10**13}
    )  # empty, and refilling only in the far future
    call = running.stub.Admit(warm("sb-waiting", "acme", 30), timeout=40)
    await eventually(lambda: _at_least(redis, prefix, 1), what="queued")
    call.cancel()
    with pytest.raises(asyncio.CancelledError):
        await call
    assert await eventually(lambda: queue_is_empty(redis, prefix))
    # And with the bucket refilled, an outsider takes the token: nothing was kept.
    await redis.delete(f"{prefix}{{adm}}:cluster-bucket")
    outsider = await eventually(
        lambda: _admitted(running.stub, warm("sb-out", "l1")), what="outsider admitted"
    )
    assert outsider


async def _admitted(stub: Any, request: admission_pb2.AdmitRequest) -> bool:
    answer = await stub.Admit(request)
    if answer.decision == ADMITTED:
        await stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=answer.hold_id))
        return True
    return False


async def test_a_dead_replicas_waiters_are_dropped_and_the_rest_served(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    await running.stub.Admit(warm("sb-first", "acme"))
    # Waiters a replica left behind when it died: it never ticks again.
    dead = AdmissionStore(redis, AdmissionSettings(redis_prefix=prefix))
    for n in range(5):
        await dead.enqueue(f"dead-{n}", "heavy", "dead-replica", 30_000, 600_000)
    await redis.zadd(f"{prefix}{{adm}}:q:owners", {"dead-replica": 0})  # its lease is over
    answers = await asyncio.gather(
        *(running.stub.Admit(warm(f"sb-{n}", "l1", 10), timeout=15) for n in range(3))
    )
    assert all(a.decision == ADMITTED for a in answers)
    assert await eventually(lambda: _no_waiters(redis, prefix))
    for answer in answers:
        await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=answer.hold_id))


async def test_without_a_budget_the_answer_comes_at_once(start_admission: Any) -> None:
    running = await start_admission(**settings(rate=0.001))
    await running.stub.Admit(warm("sb-first", "acme"))
    answer = await running.stub.Admit(warm("sb-2", "acme"))
    assert answer.decision == admission_pb2.DECISION_REFUSED
    assert not answer.HasField("waited")
    assert answer.queue_position == 0


async def test_a_negative_budget_is_invalid(start_admission: Any) -> None:
    running = await start_admission(**settings())
    request = warm("sb-1", "acme")
    request.wait_budget.CopyFrom(Duration(seconds=-1))
    with pytest.raises(grpc.aio.AioRpcError) as error:
        await running.stub.Admit(request)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# With the decision log (SPEC Q3, Q4): a call that waits is logged once, with its
# final decision; a dry run never waits.


async def _sandboxes(redis: Any, stream: str) -> list[tuple[str, str]]:
    """The log's entries, oldest first: (sandbox, kind)."""
    return [
        (fields[b"sandbox"].decode(), fields[b"kind"].decode())
        for _, fields in await redis.xrange(stream)
    ]


async def _waits(redis: Any, stream: str) -> dict[str, int | None]:
    """Each logged sandbox's ``wait`` field in ms (None: the entry has none)."""
    return {
        fields[b"sandbox"].decode(): int(fields[b"wait"]) if b"wait" in fields else None
        for _, fields in await redis.xrange(stream)
    }


async def _listed_wait_ms(running: Any, sandbox_id: str) -> int:
    """The wait ``ListDecisions`` reports for the sandbox's one entry."""
    page = await running.stub.ListDecisions(
        admission_pb2.ListDecisionsRequest(sandbox_id=sandbox_id)
    )
    (entry,) = page.decisions
    assert entry.HasField("waited")
    return int(entry.waited.ToMilliseconds())


async def test_a_granted_waiter_is_logged_once_when_admitted(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    limits = LimitsStore(redis, prefix)
    await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    task = asyncio.ensure_future(running.stub.Admit(warm("sb-waits", "acme", 20), timeout=30))
    await eventually(partial(_at_least, redis, prefix, 1), what="the waiter queued")
    # Its refusal on joining was not logged: only the first call's admission is.
    assert await _sandboxes(redis, running.keys.decision_stream("acme")) == [
        ("sb-first", "admitted")
    ]
    await limits.set_cluster(ClusterLimits(rate=20, burst=1))
    answer = await task
    assert answer.decision == ADMITTED, answer.message
    assert answer.HasField("waited")
    assert await _sandboxes(redis, running.keys.decision_stream("acme")) == [
        ("sb-first", "admitted"),
        ("sb-waits", "admitted"),
    ]
    # The entry says how long it waited; the call that did not wait has no wait.
    waits = await _waits(redis, running.keys.decision_stream("acme"))
    assert waits["sb-first"] is None
    assert waits["sb-waits"] is not None
    assert 0 < waits["sb-waits"] <= answer.waited.ToMilliseconds() + 1
    assert await _listed_wait_ms(running, "sb-waits") == waits["sb-waits"]


async def test_a_waiter_whose_budget_ends_is_logged_once_refused(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    await LimitsStore(redis, prefix).set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    answer = await running.stub.Admit(warm("sb-waits", "acme", 0.3), timeout=10)
    assert answer.decision == REFUSED
    assert answer.HasField("waited")
    assert await _sandboxes(redis, running.keys.decision_stream("acme")) == [
        ("sb-first", "admitted"),
        ("sb-waits", "refused"),
    ]
    assert await waiters(redis, prefix) == 0
    # Its final decision came when the 0.3 s budget ended, and says so.
    waited = (await _waits(redis, running.keys.decision_stream("acme")))["sb-waits"]
    assert waited is not None
    assert 290 <= waited <= answer.waited.ToMilliseconds() + 1


async def test_a_dry_run_with_a_wait_budget_is_decided_at_once_and_never_queued_but_says_where(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    running = await start_admission(**settings())
    prefix = running.settings.redis_prefix
    await LimitsStore(redis, prefix).set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    request = warm("sb-dry", "acme", 20)
    request.dry_run = True
    answer = await asyncio.wait_for(running.stub.Admit(request, timeout=30), timeout=5)
    assert answer.decision == REFUSED
    assert answer.dry_run
    assert not answer.HasField("waited")
    # Where it would have joined, alone at one token in 1000 s (SPEC Q4: nothing joined).
    assert answer.queue_position == 1
    assert answer.estimated_wait.ToMilliseconds() == 1_000_000
    assert "would have waited in the fair queue at position 1" in answer.message
    assert await waiters(redis, prefix) == 0
    assert await _sandboxes(redis, running.keys.decision_stream("acme")) == [
        ("sb-first", "admitted")
    ]


async def test_in_shadow_mode_a_call_is_admitted_at_once_and_told_where_it_would_have_waited(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    """The rate policy in shadow mode never refuses, so nothing waits; a call with
    a wait budget that only the cluster bucket would have refused is told the
    position and estimate enforcement would have queued it at, and counted."""
    values = settings()
    values["rate"] = {**values["rate"], "mode": "shadow"}
    running = await start_admission(**values)
    prefix = running.settings.redis_prefix
    await LimitsStore(redis, prefix).set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "acme"))).decision == ADMITTED
    shadowed = (
        REGISTRY.get_sample_value(
            "turnstile_admission_queue_shadow_total", {"level": "interactive"}
        )
        or 0
    )
    answers = [
        await asyncio.wait_for(running.stub.Admit(warm(f"sb-{n}", "acme", 20)), timeout=5)
        for n in range(2)
    ]
    for answer in answers:
        assert answer.decision == ADMITTED
        assert not answer.HasField("waited")
        [rate] = [v for v in answer.verdicts if v.policy == admission_pb2.POLICY_RATE]
        assert rate.verdict == admission_pb2.VERDICT_SHADOW_REFUSE
        # Nothing joined, so each would have been first.
        assert answer.queue_position == 1
        assert answer.estimated_wait.ToMilliseconds() == 1_000_000
    assert await waiters(redis, prefix) == 0
    assert (
        REGISTRY.get_sample_value(
            "turnstile_admission_queue_shadow_total", {"level": "interactive"}
        )
        == shadowed + 2
    )
    # Without a budget it would have been refused, not queued: nothing to report.
    plain = await running.stub.Admit(warm("sb-plain", "acme"))
    assert plain.decision == ADMITTED
    assert plain.queue_position == 0


async def test_every_replica_reports_the_queues_fairness_of_the_last_minute(
    start_admission: Any,
) -> None:
    values = settings(rate=40.0)
    values["queue"] = {"tick_interval_s": 0.01, "fairness_interval_s": 0.05}
    # The gauge is this process's: an earlier test's value must not pass for ours.
    metrics.QUEUE_FAIRNESS.labels("interactive").set(math.nan)
    one = await start_admission(**values)
    two = await start_admission(**values)

    async def admit(running: Any, n: int, key: str) -> Any:
        return await running.stub.Admit(warm(f"sb-{key}-{n}", key, 10), timeout=15)

    answers = await asyncio.gather(
        *(admit(one if n % 2 else two, n, key) for n in range(12) for key in ("heavy", "l1"))
    )
    assert all(a.decision == admission_pb2.DECISION_ADMITTED for a in answers)

    async def scored() -> bool:
        value = REGISTRY.get_sample_value(
            "turnstile_admission_queue_fairness", {"level": "interactive"}
        )
        return value is not None and not math.isnan(value)

    await eventually(scored, what="the fairness gauge is set")
    value = REGISTRY.get_sample_value(
        "turnstile_admission_queue_fairness", {"level": "interactive"}
    )
    assert value is not None
    assert value >= 0.95  # both keys served in turn


async def test_a_burst_of_one_keys_waiters_stops_at_its_share_of_the_queue(
    start_admission: Any, redis: aioredis.Redis
) -> None:
    """Ten calls of one key at once, the key allowed 3 waiters: 3 wait, 7 are refused
    at once saying why; another key still joins behind them."""
    running = await start_admission(**{**settings(), "queue": {"max_key_waiters": 3}})
    prefix = running.settings.redis_prefix
    limits = LimitsStore(redis, prefix)
    await limits.set_cluster(ClusterLimits(rate=0.001, burst=1))
    assert (await running.stub.Admit(warm("sb-first", "heavy"))).decision == ADMITTED

    async def admit(sandbox_id: str, client: str) -> Any:
        return await running.stub.Admit(warm(sandbox_id, client, 20), timeout=30)

    tasks = [asyncio.create_task(admit(f"sb-{n}", "heavy")) for n in range(10)]
    # The bucket is shut: only a refusal answers a heavy call now.
    await eventually(lambda: sum(t.done() for t in tasks) >= 7, what="7 heavy answers")
    assert await waiters(redis, prefix) == 3
    light = asyncio.create_task(admit("sb-light", "l1"))
    await eventually(partial(_at_least, redis, prefix, 4), what="the light waiter")
    refused = [t for t in tasks if t.done()]
    assert len(refused) == 7
    for task in refused:
        answer = task.result()
        assert answer.decision == REFUSED
        assert "the fair queue was full for its key (3 of its calls waiting" in answer.message
    await limits.set_cluster(ClusterLimits(rate=RATE, burst=1))
    answers = await asyncio.gather(*tasks, light)
    assert sum(a.decision == ADMITTED for a in answers) == 4  # 3 heavy, 1 light
