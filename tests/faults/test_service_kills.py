"""A service SIGKILLed in the middle of an activation (SPEC X6, F4, F5).

The kill lands at one exact moment: when the API-server emulator commits the sandbox's
pod, an observer kills the process before the create is answered. So the activation
is past Admit (a hold, an in-flight lease and a pending entry exist) and its runtime
exists, but nothing after that has happened.

* **Admission** killed there: the substrate goes on, records the pod and cannot commit
  the hold. The activation succeeds (its runtime exists and is recorded); the hold
  expires on its own; admission, started again, has nothing in flight or pending once
  the TTLs have passed, and counts the sandbox live.
* **The substrate** killed there (admission alive): the pod exists with no record and
  the hold is never settled. A second replica takes the lead, and either activates the
  sandbox at once (it finds and adopts the runtime) or after its sweep removed the
  orphan (it creates a new one): exactly one runtime either way, every pod recorded,
  nothing stranded. Written against behaviour, not against how the substrate keeps two
  activations of one sandbox apart, so it holds whatever that mechanism is.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_admission.app import create_app as create_admission
from turnstile_admission.keys import AdmissionKeys
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.errors import decode
from turnstile_substrate.app import create_app as create_substrate
from turnstile_substrate.db import records
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.runtime import LABEL_SANDBOX_ID
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kube_emulator.store import ADDED, DELETED, Event
from turnstile_testing.service_process import ServiceProcess

from .invariants import Ledger, live_pods, settled
from .settings import CLIENT, admission_settings, as_env, k8s_env, substrate_settings

pytestmark = [pytest.mark.faults, pytest.mark.timeout(300)]

ACME = common_pb2.ActivationClient(client_id=CLIENT)
#: Upper bound of a client's retries of one activation (only a failure reaches it).
RETRY_FOR_S = 90.0


def activate(sandbox: str) -> substrate_pb2.ActivateRequest:
    return substrate_pb2.ActivateRequest(sandbox_id=sandbox, client=ACME)


def kill_when_created(kube: KubeEmulator, sandbox: str, victim: ServiceProcess) -> asyncio.Event:
    """SIGKILL ``victim`` the moment ``sandbox``'s pod is committed, before the create is
    answered; the event is set once it was."""
    killed = asyncio.Event()

    def observe(event: Event) -> None:
        labels = event.pod.obj["metadata"].get("labels") or {}
        if event.type == ADDED and labels.get(LABEL_SANDBOX_ID) == sandbox:
            kube.store.remove_observer(observe)
            victim.kill()
            killed.set()

    kube.store.add_observer(observe)
    return killed


async def activate_retrying(
    stub: substrate_pb2_grpc.SubstrateServiceAsyncStub, sandbox: str
) -> substrate_pb2.ActivateResponse:
    """Activate as a client does: retry an UNAVAILABLE answer after its hint."""
    async with asyncio.timeout(RETRY_FOR_S):
        while True:
            try:
                return await stub.Activate(activate(sandbox), timeout=30)
            except grpc.aio.AioRpcError as error:
                rich = decode(error)
                if rich.code != grpc.StatusCode.UNAVAILABLE:
                    raise
                await asyncio.sleep(rich.retry_after_s or 0.2)


async def unsettled_holds(redis: aioredis.Redis, redis_prefix: str) -> int:
    """Hold records in Redis, read from Redis itself (admission may be dead): a commit or
    a cancel deletes its hold, one nobody settled stays until its key expires (a minute
    after the hold does, for a late cancel), whatever the machine's speed."""
    return len([k async for k in redis.scan_iter(match=AdmissionKeys(redis_prefix).hold("*"))])


@dataclass(frozen=True)
class World:
    """What the services of one test share: the emulator, a migrated database, Redis."""

    kube: KubeEmulator
    database_url: str
    redis: aioredis.Redis
    redis_url: str
    redis_prefix: str
    logs: Path

    async def settled(self, admission_address: str) -> tuple[Ledger, float]:
        return await settled(admission_address, self.redis, self.redis_prefix, self.kube)

    async def recorded_runtimes(self) -> dict[str, str]:
        """Sandbox id → pod name of every active execution."""
        conn = await asyncpg.connect(self.database_url)
        try:
            active = await records.active_runtimes(conn, "kubernetes")
        finally:
            await conn.close()
        return {a.sandbox_id: name for name, a in active.items()}

    def substrate_process(
        self, identity: str, admission_addr: str, orphan_grace_s: float
    ) -> ServiceProcess:
        """A Kubernetes substrate replica as a process (not started)."""
        settings = substrate_settings(
            self.redis_url, self.redis_prefix, self.database_url, admission_addr
        )
        env = {
            **as_env(settings),
            **k8s_env(
                self.kube, leader_identity=identity, sweep_orphan_grace_s=str(orphan_grace_s)
            ),
        }
        return ServiceProcess("turnstile_substrate", env, self.logs / f"{identity}.log")


@pytest.fixture
async def world(
    database_url: str, redis: aioredis.Redis, redis_url: str, redis_prefix: str, tmp_path: Path
) -> AsyncIterator[World]:
    await asyncio.to_thread(apply_migrations, database_url)
    async with KubeEmulator(bookmark_interval=0.2) as kube:
        yield World(kube, database_url, redis, redis_url, redis_prefix, tmp_path)


# -- admission killed between Admit and CommitHold ---------------------------------


async def test_admission_killed_between_admit_and_commit_strands_nothing(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    kube = world.kube
    settings = admission_settings(world.redis_url, world.redis_prefix)
    admission = await ServiceProcess(
        "turnstile_admission", as_env(settings), world.logs / "admission.log"
    ).start()
    for name, value in k8s_env(kube).items():
        monkeypatch.setenv(name, value)
    substrate = await create_substrate(
        SubstrateSettings.model_validate(
            substrate_settings(
                world.redis_url, world.redis_prefix, world.database_url, admission.address
            )
        )
    )
    await substrate.start()
    channel = grpc.aio.insecure_channel(substrate.address)
    stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
    try:
        killed = kill_when_created(kube, "victim", admission)

        answer = await stub.Activate(activate("victim"), timeout=30)

        assert killed.is_set()
        assert admission.returncode == -9
        # made and recorded: a success, whose hold could not be committed
        assert answer.outcome == substrate_pb2.OUTCOME_CREATED
        assert await unsettled_holds(world.redis, world.redis_prefix) == 1
        assert live_pods(kube) == {"victim": [answer.sandbox.runtime_name]}
        assert await world.recorded_runtimes() == {"victim": answer.sandbox.runtime_name}
        # with admission down, nothing new is admitted, nothing made
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await stub.Activate(activate("other"), timeout=30)
        rich = decode(refused.value)
        assert (rich.code, rich.metadata.get("dependency")) == (
            grpc.StatusCode.UNAVAILABLE,
            "admission",
        )
        assert rich.retryable
        assert "other" not in live_pods(kube)

        await admission.start()  # the same port, the same Redis

        after, took = await world.settled(admission.address)
        print(f"\nadmission: settled {took:.1f} s after its restart: {after}")
        assert after.live == {"victim"}  # counted live: live + pending == runtimes
        assert after.drift(live_pods(kube)) == 0
        assert after.immortal_holds == 0
        other = await activate_retrying(stub, "other")  # decisions resumed by themselves
        assert other.outcome == substrate_pb2.OUTCOME_CREATED
        for sandbox in ("victim", "other"):
            await stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=sandbox), timeout=30)
        final, _ = await world.settled(admission.address)
        assert (final.live, final.node_slots, live_pods(kube)) == (frozenset(), {}, {})
    finally:
        await channel.close(None)
        await substrate.stop()
        await admission.stop()


# -- the substrate killed mid-activation -------------------------------------------


@pytest.mark.parametrize(
    ("retry", "orphan_grace_s"),
    # the sweep takes a pod no record names once it is this old: long enough for the
    # retry at once to find it, short enough for the sweep to come first in the other
    [("at once", 300.0), ("after the sweep", 2.0)],
)
async def test_a_substrate_killed_mid_activation_leaves_one_runtime_and_nothing_stranded(
    world: World, retry: str, orphan_grace_s: float
) -> None:
    kube = world.kube
    admission = await create_admission(
        AdmissionSettings.model_validate(admission_settings(world.redis_url, world.redis_prefix))
    )
    await admission.start()
    first = world.substrate_process("first", admission.address, orphan_grace_s)
    second = world.substrate_process("second", admission.address, orphan_grace_s)
    deleted = asyncio.Event()
    kube.store.add_observer(lambda e: deleted.set() if e.type == DELETED else None)
    try:
        # both up before the kill (a second replica is what a fleet has; starting it
        # afterwards would only add an interpreter's start to the test)
        await asyncio.gather(first.start(), second.start())
        killed = kill_when_created(kube, "victim", first)
        async with grpc.aio.insecure_channel(first.address) as channel:
            with pytest.raises(grpc.aio.AioRpcError) as lost:
                await substrate_pb2_grpc.SubstrateServiceStub(channel).Activate(
                    activate("victim"), timeout=30
                )
        assert killed.is_set()
        assert first.returncode == -9
        assert lost.value.code() == grpc.StatusCode.UNAVAILABLE  # the connection went away
        orphan = live_pods(kube)["victim"]
        assert await world.recorded_runtimes() == {}  # made, never recorded
        # a hold nobody will settle (its in-flight lease expires with it)
        assert await unsettled_holds(world.redis, world.redis_prefix) == 1

        async with grpc.aio.insecure_channel(second.address) as channel:
            stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
            if retry == "after the sweep":
                # the leader's sweep (the second replica's, once the first's lease has
                # lapsed) finds the pod no record names, and removes it
                await asyncio.wait_for(deleted.wait(), RETRY_FOR_S)
                assert "victim" not in live_pods(kube)
            answer = await activate_retrying(stub, "victim")

            pods = live_pods(kube)
            assert pods == {"victim": [answer.sandbox.runtime_name]}  # exactly one runtime
            if retry == "at once":
                assert answer.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING
                assert pods["victim"] == orphan  # adopted, not made again
            else:
                assert answer.outcome == substrate_pb2.OUTCOME_CREATED
            assert await world.recorded_runtimes() == {"victim": answer.sandbox.runtime_name}

            after, took = await world.settled(admission.address)
            print(f"\nsubstrate ({retry}): settled in {took:.1f} s: {after}")
            assert after.live == {"victim"}
            assert after.drift(live_pods(kube)) == 0
            assert after.immortal_holds == 0

            await stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="victim"), timeout=30)
            final, _ = await world.settled(admission.address)
            assert (final.live, final.node_slots, live_pods(kube)) == (frozenset(), {}, {})
            assert await world.recorded_runtimes() == {}
    except BaseException:
        print(f"--- first\n{first.output()}\n--- second\n{second.output()}")
        raise
    finally:
        await second.stop()
        first.kill()
        await admission.stop()
