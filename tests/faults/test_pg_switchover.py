"""A PostgreSQL switchover under steady activations (issue 11, SPEC F3, F7, X6).

The substrate (Kubernetes, on the API-server emulator) and the real admission service
run in this process over real gRPC sockets; the substrate's database URL names a
primary and its streaming standby with ``target_session_attrs=read-write``. While
workers activate, read and deactivate sandboxes, the primary is stopped
(``pg_ctl stop -m fast``) and the standby promoted (``pg_ctl promote``). Every call
answers within its bound, with success or UNAVAILABLE and a retry hint (never
INTERNAL, never a hang); after the switch calls succeed against the new primary
without a restart; no committed activation is lost; and once the TTLs have passed
nothing is left in admission and the live set equals the pods.

The figures (the gap with no successful write against the switchover's own duration,
the answers by class) are printed: run with ``-s``.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import TypeVar

import asyncpg
import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission.app import create_app as create_admission
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.errors import decode
from turnstile_platform.server import GrpcService
from turnstile_substrate.app import create_app as create_substrate
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.replication import PostgresPair, Switchover

from .invariants import live_pods, settled
from .settings import CLIENT, admission_settings, k8s_env, substrate_settings

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

#: The substrate's budget per statement and pool wait (production default: 5 s).
DB_BUDGET_S = 1.0
#: What one call may take: an Activate runs a handful of statements, each bounded by the
#: budget, around calls to admission and the API server; 3 budgets is far above what the
#: switch costs (connections fail at once, then the breaker answers at once) and still
#: catches a hang. Slack for a loaded 2-core machine.
BOUND_S = 3 * DB_BUDGET_S + 2.0
#: A call that gets no answer by this deadline hung.
DEADLINE_S = 30.0
WORKERS = 8
STEADY_S = 2.0
#: Successful activations after the switch before the load stops.
AFTER = 20
ACME = common_pb2.ActivationClient(client_id=CLIENT)

T = TypeVar("T")


@dataclass(frozen=True)
class Call:
    rpc: str
    started: float
    seconds: float
    #: ``OK`` or the status code's name.
    code: str
    reason: str = ""
    #: ``ErrorInfo`` metadata's ``dependency``: which one was unavailable.
    dependency: str = ""
    retryable: bool = False
    #: A success that needed the primary: an Activate that made a runtime (not one
    #: answered ALREADY_RUNNING from the runtime, which needs no database) or a Deactivate.
    wrote: bool = False

    @property
    def ended(self) -> float:
        return self.started + self.seconds

    @property
    def answer_class(self) -> str:
        if self.code == "OK":
            return "OK"
        hint = "retry hint" if self.retryable else "no retry hint"
        return f"{self.code} {self.reason or '-'} {self.dependency} ({hint})"


@dataclass
class Stack:
    pair: PostgresPair
    database_url: str
    kube: KubeEmulator
    admission: GrpcService
    substrate: GrpcService
    stub: substrate_pb2_grpc.SubstrateServiceAsyncStub


@pytest.fixture
async def stack(
    postgres_pair: PostgresPair,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Stack]:
    admin = await asyncpg.connect(postgres_pair.first.url)
    try:
        await admin.execute("CREATE DATABASE turnstile")
    finally:
        await admin.close()
    primary_url = postgres_pair.first.url.rpartition("/")[0] + "/turnstile"
    await asyncio.to_thread(apply_migrations, primary_url)
    async with KubeEmulator(bookmark_interval=0.2) as kube:
        for name, value in k8s_env(kube).items():
            monkeypatch.setenv(name, value)
        admission = await create_admission(
            AdmissionSettings.model_validate(admission_settings(redis_url, redis_prefix))
        )
        await admission.start()
        substrate = await create_substrate(
            SubstrateSettings.model_validate(
                substrate_settings(
                    redis_url,
                    redis_prefix,
                    postgres_pair.with_database("turnstile"),
                    admission.address,
                    database_timeout_s=DB_BUDGET_S,
                    activation_lock_timeout_s=2 * DB_BUDGET_S,
                )
            )
        )
        await substrate.start()
        channel = grpc.aio.insecure_channel(substrate.address)
        try:
            yield Stack(
                postgres_pair,
                postgres_pair.with_database("turnstile"),
                kube,
                admission,
                substrate,
                substrate_pb2_grpc.SubstrateServiceStub(channel),
            )
        finally:
            await channel.close(None)
            await substrate.stop()
            await admission.stop()


@dataclass
class Load:
    """The calls the workers made, and when enough writes succeeded after the switch."""

    calls: list[Call] = field(default_factory=list)
    activated: set[str] = field(default_factory=set)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    #: When the new primary took over (set by the test), and writes that succeeded since.
    switched: float | None = None
    writes_after: int = 0
    enough_after: asyncio.Event = field(default_factory=asyncio.Event)

    async def timed(self, rpc: str, call: Callable[[], Awaitable[T]]) -> T | None:
        """Make one call (``call()`` starts it), record its answer and how long it took;
        its response, if any."""
        loop = asyncio.get_running_loop()
        started = loop.time()
        try:
            response = await call()
        except grpc.aio.AioRpcError as error:
            rich = decode(error)
            seconds = loop.time() - started
            dependency = rich.metadata.get("dependency", "")
            self.calls.append(
                Call(rpc, started, seconds, rich.code.name, rich.reason, dependency, rich.retryable)
            )
            return None
        wrote = rpc == "Deactivate" or (
            isinstance(response, substrate_pb2.ActivateResponse)
            and response.outcome != substrate_pb2.OUTCOME_ALREADY_RUNNING
        )
        self.calls.append(Call(rpc, started, loop.time() - started, "OK", wrote=wrote))
        if wrote and self.switched is not None and started > self.switched:
            self.writes_after += 1
            if self.writes_after >= AFTER:
                self.enough_after.set()
        return response

    async def worker(self, stub: substrate_pb2_grpc.SubstrateServiceAsyncStub, n: int) -> None:
        """Round after round over three sandboxes of its own: activate one and read it, and
        deactivate the one activated two rounds ago (so about two run at any time)."""
        for round_ in itertools.count():
            if self.stop.is_set():
                return
            sandbox, oldest = f"sw-{n}-{round_ % 3}", f"sw-{n}-{(round_ + 1) % 3}"
            activate = substrate_pb2.ActivateRequest(sandbox_id=sandbox, client=ACME)
            get = substrate_pb2.GetSandboxRequest(sandbox_id=sandbox)
            deactivate = substrate_pb2.DeactivateRequest(sandbox_id=oldest)
            if await self.timed(
                "Activate", functools.partial(stub.Activate, activate, timeout=DEADLINE_S)
            ):
                self.activated.add(sandbox)
                await self.timed(
                    "GetSandbox", functools.partial(stub.GetSandbox, get, timeout=DEADLINE_S)
                )
            await self.timed(
                "Deactivate", functools.partial(stub.Deactivate, deactivate, timeout=DEADLINE_S)
            )


async def test_a_switchover_under_load_answers_every_call_retryably_and_loses_nothing(
    stack: Stack, redis: aioredis.Redis, redis_prefix: str
) -> None:
    loop = asyncio.get_running_loop()
    load = Load()
    workers = [asyncio.create_task(load.worker(stack.stub, n)) for n in range(WORKERS)]
    await asyncio.sleep(STEADY_S)  # steady load before the switch
    switch_started = loop.time()
    took: Switchover = await asyncio.to_thread(stack.pair.switchover)
    switched = load.switched = loop.time()
    # then until enough activations succeeded on the new primary
    await asyncio.wait_for(load.enough_after.wait(), 120)
    load.stop.set()
    await asyncio.gather(*workers)
    calls, activated = load.calls, load.activated

    # -- every answer: success, or UNAVAILABLE with a retry hint, within the bound
    by_class = Counter((c.rpc, c.answer_class) for c in calls)
    activations = sorted(c.ended for c in calls if c.rpc == "Activate" and c.code == "OK")
    writes = sorted(c.ended for c in calls if c.wrote)
    no_activation = max(b - a for a, b in itertools.pairwise(activations))
    gap_start, gap_end = max(itertools.pairwise(writes), key=lambda p: p[1] - p[0])
    first_after = min(t for t in writes if t > switched)
    slowest = max(calls, key=lambda c: c.seconds)
    during = [c for c in calls if c.ended > switch_started and c.started < first_after]
    print(
        f"\nswitchover {took.total_s:.2f} s (stop {took.stop_s:.2f} s, promote "
        f"{took.promote_s:.2f} s); longest gap with no successful write (an Activate that "
        f"made a runtime, a Deactivate) {gap_end - gap_start:.2f} s "
        f"({gap_start - switch_started:+.2f} s to {gap_end - switch_started:+.2f} s from the "
        f"stop), with no successful Activate of any outcome {no_activation:.2f} s; first write "
        f"{first_after - switched:.2f} s after the promotion; slowest call {slowest.rpc} "
        f"{slowest.seconds:.2f} s; {len(during)} calls answered during the switch; "
        f"load {os.getloadavg()[0]:.1f}"
    )
    during_by_class = Counter((c.rpc, c.answer_class) for c in during)
    for (rpc, answer), count in sorted(by_class.items()):
        print(f"  {rpc:<11} {answer}: {count} ({during_by_class[(rpc, answer)]} during the switch)")
    wrong = [c for c in calls if c.code != "OK" and (c.code != "UNAVAILABLE" or not c.retryable)]
    assert not wrong, wrong[:5]
    assert slowest.seconds <= BOUND_S, slowest
    assert any(c.code == "UNAVAILABLE" for c in during)  # the switch was felt...
    assert first_after - switched < 30  # ...and calls succeed again without a restart

    # -- no committed activation was lost: each has its record on the new primary
    conn = await asyncpg.connect(stack.database_url)
    try:
        assert await conn.fetchval("SHOW port") == str(stack.pair.second.port)
        recorded = {r["id"] for r in await conn.fetch("SELECT id FROM sandboxes")}
    finally:
        await conn.close()
    assert activated <= recorded, activated - recorded

    # -- nothing stranded: live + pending equals the pods, then nothing at all
    pods = live_pods(stack.kube)
    assert all(len(names) == 1 for names in pods.values()), pods  # one runtime per sandbox
    after_load, settle_s = await settled(stack.admission.address, redis, redis_prefix, stack.kube)
    print(
        f"settled {settle_s:.1f} s after the load: {len(after_load.live)} live, "
        f"drift {after_load.drift(live_pods(stack.kube))}"
    )
    assert after_load.immortal_holds == 0
    for sandbox in sorted(activated):  # a client ends what it started
        await stack.stub.Deactivate(
            substrate_pb2.DeactivateRequest(sandbox_id=sandbox), timeout=DEADLINE_S
        )
    final, _ = await settled(stack.admission.address, redis, redis_prefix, stack.kube)
    assert live_pods(stack.kube) == {}
    assert (final.live, final.node_slots) == (frozenset(), {})
