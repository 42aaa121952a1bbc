"""Fixtures of the admission tests: the real service on a real socket, and the live
counts in Redis written the way the substrate's leader writes them."""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass, field
from functools import partial
from typing import Any, TypeVar

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission.keys import AdmissionKeys
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import LiveCountKeys
from turnstile_clientkeys.live_counts import COUNTED, UNSUPPORTED
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_platform.server import GrpcService
from turnstile_testing.admission import admission_settings, running_admission
from turnstile_testing.eventually import eventually
from turnstile_testing.proxies import ReplyHoldingProxy
from turnstile_testing.redis_topologies import single_server_port


@dataclass
class LiveSets:
    """The live counts a substrate leader keeps (``turnstile_clientkeys.live_counts``):
    each key's live set, and the marker that says whether they are current."""

    redis: aioredis.Redis
    keys: LiveCountKeys

    async def counted(self, key: str = "acme", *live: str) -> None:
        """The counts are current, and ``key``'s live sandboxes are ``live``."""
        await self.redis.delete(self.keys.live(key))
        if live:
            await self.redis.sadd(self.keys.live(key), *live)
        await self.redis.set(self.keys.state, COUNTED)

    async def unsupported(self) -> None:
        await self.redis.set(self.keys.state, UNSUPPORTED)

    async def unavailable(self) -> None:
        await self.redis.delete(self.keys.state)


@pytest.fixture
async def live(redis: aioredis.Redis, redis_prefix: str) -> LiveSets:
    """Live counts current and empty, as a healthy leader with no pods keeps them."""
    sets = LiveSets(redis, LiveCountKeys(redis_prefix))
    await sets.counted()
    return sets


@dataclass
class Running:
    app: GrpcService
    stub: admission_pb2_grpc.AdmissionServiceAsyncStub
    channel: grpc.aio.Channel
    settings: AdmissionSettings
    keys: AdmissionKeys = field(init=False)

    def __post_init__(self) -> None:
        self.keys = AdmissionKeys(self.settings.redis_prefix)


Start = Callable[..., Awaitable[Running]]


@pytest.fixture
async def start_admission(
    redis_url: str, redis_prefix: str, live: LiveSets
) -> AsyncIterator[Start]:
    """Start the admission service on a free port; settings may be overridden."""
    async with AsyncExitStack() as stack:

        async def start(**overrides: Any) -> Running:
            tracer_provider = overrides.pop("tracer_provider", None)
            settings = admission_settings(redis_url, redis_prefix, **overrides)
            app = await stack.enter_async_context(
                running_admission(settings, tracer_provider=tracer_provider)
            )
            channel = grpc.aio.insecure_channel(app.address)
            stack.push_async_callback(channel.close, None)
            stub: Any = admission_pb2_grpc.AdmissionServiceStub(channel)
            return Running(app, stub, channel, settings)

        yield start


@pytest.fixture
async def admission(start_admission: Start) -> Running:
    """The admission service with default settings."""
    return await start_admission()


@pytest.fixture
async def proxy(redis_url: str) -> AsyncIterator[ReplyHoldingProxy]:
    """A proxy in front of the test Redis that can hold replies or a command back."""
    proxy = ReplyHoldingProxy(single_server_port(redis_url))
    await proxy.start()
    yield proxy
    await proxy.close()


@pytest.fixture
def start_proxied(proxy: ReplyHoldingProxy, start_admission: Start) -> Start:
    """Start admission on Redis through ``proxy``: a short budget, the breaker out of
    the way, the test clock on; settings may be overridden."""

    async def start(**overrides: Any) -> Running:
        return await start_admission(
            **{
                "redis_url": f"redis://127.0.0.1:{proxy.port}/0",
                "redis_timeout_s": 0.25,
                "client_allowlist": ("acme",),
                "test_clock": True,
                "breaker_failures": 1000,
                **overrides,
            }
        )

    return start


@dataclass(frozen=True)
class TimedAdmit:
    """One Admit under load: when it started, how long it took, and whether a fail
    mode answered it (a policy's backend was unavailable)."""

    started: float
    seconds: float
    by_fail_mode: bool

    @property
    def ended(self) -> float:
        return self.started + self.seconds


def by_fail_mode(answer: Any) -> bool:
    """Whether a policy other than the cap was decided by its fail mode."""
    return any(
        v.verdict == admission_pb2.VERDICT_UNKNOWN or "POLICY_BACKEND_UNAVAILABLE" in v.detail
        for v in answer.verdicts
        if v.policy != admission_pb2.POLICY_CAP
    )


class AdmitLoad:
    """``in_flight`` clients sending Admits back to back (cold creates on node ``n1``
    and warm claims, alternately) and settling each hold with CancelHold, as the
    substrate would: a cancel refused as UNAVAILABLE is retried until it lands, so
    whatever is left in Redis afterwards was lost by Redis, not dropped here."""

    def __init__(self, stub: Any, client_id: str = "acme", in_flight: int = 64) -> None:
        self.stub = stub
        self.client = common_pb2.ActivationClient(client_id=client_id)
        self.in_flight = in_flight
        self.decisions: list[TimedAdmit] = []
        #: Status codes of CancelHold calls that failed (each retried).
        self.cancel_failures: list[grpc.StatusCode] = []
        self._stop = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._count = 0
        self.stopped_at = 0.0

    def start(self) -> None:
        self._tasks = [asyncio.create_task(self._client(n)) for n in range(self.in_flight)]

    async def stop(self) -> None:
        self.stopped_at = asyncio.get_running_loop().time()
        self._stop.set()
        await asyncio.gather(*self._tasks)

    async def _client(self, n: int) -> None:
        loop = asyncio.get_running_loop()
        while not self._stop.is_set():
            self._count += 1
            cold = self._count % 2 == 0
            request = admission_pb2.AdmitRequest(
                sandbox_id=f"sb-{n}-{self._count}",
                client=self.client,
                kind=common_pb2.ACTIVATION_KIND_COLD_CREATE
                if cold
                else common_pb2.ACTIVATION_KIND_WARM_CLAIM,
                candidate_nodes=["n1"] if cold else [],
            )
            started = loop.time()
            answer = await self.stub.Admit(request, timeout=10)
            self.decisions.append(TimedAdmit(started, loop.time() - started, by_fail_mode(answer)))
            if answer.hold_id:
                await self._cancel(answer.hold_id)

    async def _cancel(self, hold_id: str) -> None:
        while True:
            try:
                await self.stub.CancelHold(
                    admission_pb2.CancelHoldRequest(hold_id=hold_id), timeout=10
                )
                return
            except grpc.aio.AioRpcError as error:
                self.cancel_failures.append(error.code())
                if error.code() != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(0.05)

    def normal(self) -> list[TimedAdmit]:
        return [d for d in self.decisions if not d.by_fail_mode]

    def longest_gap(self) -> float:
        """The longest time without a decision not answered by a fail mode, up to the
        moment the load stopped."""
        ends = sorted(d.ended for d in self.normal())
        return max(b - a for a, b in itertools.pairwise([*ends, self.stopped_at]))

    async def held(self) -> int:
        """What Redis still counts for the client: pending entries, holds in flight
        and node slots held (all zero once every hold is settled)."""
        usage = await self.stub.GetUsage(
            admission_pb2.GetUsageRequest(client=self.client), timeout=10
        )
        return int(usage.pending + usage.in_flight + sum(usage.node_slots_held.values()))


@pytest.fixture
def admit_load() -> type[AdmitLoad]:
    """The load generator of the fault tests (a class: start it against a stub)."""
    return AdmitLoad


def _fault_settings(budget_s: float, ttl_s: float) -> dict[str, Any]:
    return {
        "redis_timeout_s": budget_s,
        "client_allowlist": ("acme",),
        "slots": {"fail": "closed", "default_per_node": 1000},
        "rate": {
            "default_burst": 100_000,
            "default_rate_per_s": 100_000,
            "cluster_burst": 100_000,
            "cluster_rate_per_s": 100_000,
        },
        "concurrency": {"default_limit": 10_000},
        "cap": {"default_cap": 100_000},
        "hold_ttl_s": ttl_s,
        "pending_ttl_s": ttl_s,
        "health_check_interval_s": 0.1,
    }


@pytest.fixture
def fault_settings() -> Callable[[float, float], dict[str, Any]]:
    """Settings of the fault tests, given the Redis budget and the hold and pending
    TTLs: every policy out of the way but its fail mode (node slots fail closed)."""
    return _fault_settings


T = TypeVar("T")


@dataclass
class QueueProbe:
    """The fair queue's state in Redis as the queue tests read it (SPEC Q1), and
    the FIFO check the slot and per-client tests share."""

    redis: aioredis.Redis
    prefix: str

    async def waiters(self) -> int:
        return int(await self.redis.hlen(f"{self.prefix}{{adm}}:q:info"))

    async def at_least(self, count: int) -> bool:
        return await self.waiters() >= count

    async def empty(self) -> bool:
        """No waiter, grant, serving mark or reservation (``g:<waiter>`` in a
        node's slots, a key's leases or pending entries) is left; the queue's
        bookkeeping (virtual times, owners, settings, grant pace) outlives its
        waiters."""
        keys = [k async for k in self.redis.scan_iter(match=f"{self.prefix}{{adm}}:q*")]
        bookkeeping = (b":meta", b":vf", b"q:owners", b"q:slotq", b"q:ownq", b"q:pace")
        if [k for k in keys if not k.endswith(bookkeeping)]:
            return False
        for kind in ("slots", "inflight", "pending"):
            async for key in self.redis.scan_iter(match=f"{self.prefix}{{adm}}:{kind}:*"):
                members = await self.redis.zrange(key, 0, -1)
                if any(isinstance(m, bytes) and m.startswith(b"g:") for m in members):
                    return False
        return True

    async def peak(self, key: str, work: Awaitable[T]) -> tuple[int, T]:
        """The most members the sorted set ``key`` had while ``work`` ran (read by
        a concurrent watcher, every member counted: the tests' holds outlive
        them), and what ``work`` returned."""
        done = asyncio.Event()
        most = 0

        async def watch() -> None:
            nonlocal most
            while not done.is_set():
                most = max(most, int(await self.redis.zcard(key)))

        watcher = asyncio.create_task(watch())
        try:
            result = await work
        finally:
            done.set()
            await watcher
        return most, result

    async def served_in_order(
        self,
        stub: Any,
        requests: list[admission_pb2.AdmitRequest],
        hold_id: str,
        settle: Callable[[str], Awaitable[object]],
    ) -> tuple[list[str], str]:
        """Queue ``requests`` one after the other (each joined before the next is
        sent), then ``settle`` the hold in the way (``hold_id``) and each admitted
        one in turn, freeing room for one waiter at a time. Returns the sandboxes
        in the order they were admitted, and the last one's hold (left held)."""
        order: list[str] = []

        async def call(request: admission_pb2.AdmitRequest) -> str:
            answer = await stub.Admit(request, timeout=30)
            assert answer.decision == admission_pb2.DECISION_ADMITTED, answer.message
            order.append(request.sandbox_id)
            return str(answer.hold_id)

        tasks = []
        for n, request in enumerate(requests):
            tasks.append(asyncio.create_task(call(request)))
            await eventually(partial(self.at_least, n + 1), what=f"waiter {n} queued")
        for task in tasks:
            await settle(hold_id)
            hold_id = await task
        return order, hold_id


@pytest.fixture
def queue(redis: aioredis.Redis, redis_prefix: str) -> QueueProbe:
    return QueueProbe(redis, redis_prefix)
