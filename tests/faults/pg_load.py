"""What the PostgreSQL failover tests share: the services on a primary and its standby,
and steady activations whose every answer is recorded (SPEC F3, F7, X6).

The substrate (Kubernetes, on the API-server emulator) and the real admission service
run in this process over real gRPC sockets; the substrate's database URL names a
primary and its streaming standby with ``target_session_attrs=read-write``. Eight
workers activate, read and deactivate sandboxes of their own, round after round.
"""

from __future__ import annotations

import asyncio
import functools
import itertools
import os
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import TypeVar

import asyncpg
import grpc
import grpc.aio
import pytest

from turnstile_admission.app import create_app as create_admission
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.errors import decode
from turnstile_platform.server import GrpcService
from turnstile_substrate.app import create_app as create_substrate
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.replication import PostgresPair

from .settings import CLIENT, admission_settings, k8s_env, substrate_settings

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
    #: The runtime an Activate that made one answered with (its execution's name).
    runtime_name: str = ""

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


@asynccontextmanager
async def running_stack(
    postgres_pair: PostgresPair,
    redis_url: str,
    redis_prefix: str,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Stack]:
    """Admission and the Kubernetes substrate (on the API-server emulator) in this
    process, the substrate's database URL naming both hosts of ``postgres_pair``."""
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
        made = (
            isinstance(response, substrate_pb2.ActivateResponse)
            and response.outcome != substrate_pb2.OUTCOME_ALREADY_RUNNING
        )
        wrote = rpc == "Deactivate" or made
        runtime = response.sandbox.runtime_name if made else ""  # type: ignore[attr-defined]
        seconds = loop.time() - started
        self.calls.append(Call(rpc, started, seconds, "OK", wrote=wrote, runtime_name=runtime))
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


def check_answers(calls: list[Call], switch_started: float, first_after: float) -> list[Call]:
    """Assert every answer was a success or UNAVAILABLE with a retry hint, within
    :data:`BOUND_S`, and that the fault was felt; print the answers by class. The calls
    answered during the fault (from ``switch_started`` to the first write after it)."""
    by_class = Counter((c.rpc, c.answer_class) for c in calls)
    during = [c for c in calls if c.ended > switch_started and c.started < first_after]
    during_by_class = Counter((c.rpc, c.answer_class) for c in during)
    for (rpc, answer), count in sorted(by_class.items()):
        print(f"  {rpc:<11} {answer}: {count} ({during_by_class[(rpc, answer)]} during the switch)")
    wrong = [c for c in calls if c.code != "OK" and (c.code != "UNAVAILABLE" or not c.retryable)]
    assert not wrong, wrong[:5]
    slowest = max(calls, key=lambda c: c.seconds)
    assert slowest.seconds <= BOUND_S, slowest
    assert any(c.code == "UNAVAILABLE" for c in during)  # the fault was felt
    return during


def write_gaps(calls: list[Call], switch_started: float, switched: float) -> str:
    """The longest time with no successful write and with no successful Activate, and the
    first write after the new primary took over, as a line to print."""
    activations = sorted(c.ended for c in calls if c.rpc == "Activate" and c.code == "OK")
    writes = sorted(c.ended for c in calls if c.wrote)
    no_activation = max(b - a for a, b in itertools.pairwise(activations))
    gap_start, gap_end = max(itertools.pairwise(writes), key=lambda p: p[1] - p[0])
    first_after = min(t for t in writes if t > switched)
    slowest = max(calls, key=lambda c: c.seconds)
    return (
        f"longest gap with no successful write (an Activate that made a runtime, a "
        f"Deactivate) {gap_end - gap_start:.2f} s ({gap_start - switch_started:+.2f} s to "
        f"{gap_end - switch_started:+.2f} s from the fault), with no successful Activate of "
        f"any outcome {no_activation:.2f} s; first write {first_after - switched:.2f} s after "
        f"the promotion; slowest call {slowest.rpc} {slowest.seconds:.2f} s; load "
        f"{os.getloadavg()[0]:.1f}"
    )


def first_write_after(calls: list[Call], switched: float) -> float:
    return min(c.ended for c in calls if c.wrote and c.ended > switched)


async def deactivate_all(
    stub: substrate_pb2_grpc.SubstrateServiceAsyncStub, sandboxes: set[str]
) -> None:
    """Deactivate each sandbox, retrying what is refused retryably (an activation claim
    a failed release left behind lapses within its TTL): a client ends what it started."""
    for sandbox in sorted(sandboxes):
        request = substrate_pb2.DeactivateRequest(sandbox_id=sandbox)
        async with asyncio.timeout(DEADLINE_S):
            while True:
                try:
                    await stub.Deactivate(request, timeout=DEADLINE_S)
                    break
                except grpc.aio.AioRpcError as error:
                    if not decode(error).retryable:
                        raise
                    await asyncio.sleep(0.1)
