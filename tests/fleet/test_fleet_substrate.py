"""Three substrate processes on one cluster (the API-server emulator), one PostgreSQL, one Redis,
and the real admission service: leader election, the leader-only warm pool and sweeps, and
idempotent activations across replicas (SPEC F1, F5: the substrate's part).

The default run keeps each scenario small; ``-m slow`` runs the full-size ones.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.server import GrpcService
from turnstile_substrate.db import records
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.runtime import (
    LABEL_MANAGED_BY,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TIER,
    MANAGED_BY,
    CreateKind,
    Runtime,
)
from turnstile_testing.admission import admission_settings, running_admission
from turnstile_testing.kube_emulator import KubeEmulator, KubeletConfig, pod_manifest
from turnstile_testing.kube_emulator.store import ADDED, DELETED, Event
from turnstile_testing.processes import free_port

#: Three interpreters starting on a loaded 2-core machine take a while; the waits inside are
#: events bounded by WAIT_S, so this only stops a test that is stuck.
pytestmark = pytest.mark.timeout(600)

NS = "sandboxes"
LEASE = "turnstile-substrate-leader"
LEASE_S = 4.0
RENEW_S = 3.0
RETRY_S = 0.5
#: Slack for three Python processes renewing on a loaded 2-core machine (a bound on the
#: hand-over, which SPEC F1 wants within the lease duration; waits themselves are events).
SLACK_S = 6.0
#: Upper bound of any wait: generous, since only a failure ever reaches it.
WAIT_S = 120.0


@dataclass
class Replica:
    identity: str
    address: str
    process: asyncio.subprocess.Process
    log: Path


@dataclass
class Fleet:
    kube: KubeEmulator
    database_url: str
    env: dict[str, str]
    logs: Path
    replicas: list[Replica] = field(default_factory=list)

    async def start(self, count: int) -> None:
        await asyncio.gather(*(self._start(f"replica-{i}") for i in range(count)))

    async def _start(self, identity: str) -> None:
        port = free_port()
        log = self.logs / f"{identity}.log"
        env = {
            **self.env,
            "TURNSTILE_PORT": str(port),
            "TURNSTILE_K8S_LEADER_IDENTITY": identity,
        }
        with log.open("wb") as out:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "turnstile_substrate",
                env=env,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
            )
        replica = Replica(identity, f"127.0.0.1:{port}", process, log)
        self.replicas.append(replica)
        await _serving(replica)

    def holder(self) -> str | None:
        lease = self.kube.lease(NS, LEASE)
        return None if lease is None else (lease["spec"].get("holderIdentity") or None)

    def replica(self, identity: str | None) -> Replica:
        return next(r for r in self.replicas if r.identity == identity)

    async def until(self, predicate: Callable[[], bool], timeout: float = WAIT_S) -> None:
        """Wait for ``predicate`` on the emulator's writes (pods and leases), no polling."""
        async with asyncio.timeout(timeout):
            while not predicate():
                await self.kube.store.wait_for_version(self.kube.resource_version + 1, timeout)

    def kill(self, replica: Replica) -> None:
        """SIGKILL: no shutdown, no lease release, in-flight requests dropped."""
        replica.process.send_signal(signal.SIGKILL)

    async def stop(self) -> None:
        for replica in self.replicas:
            if replica.process.returncode is None:
                replica.process.send_signal(signal.SIGTERM)
        for replica in self.replicas:
            try:
                async with asyncio.timeout(15):
                    await replica.process.wait()
            except TimeoutError:
                replica.process.kill()
                await replica.process.wait()

    def output(self) -> str:
        return "\n".join(
            f"--- {r.identity}\n{r.log.read_text(errors='replace')[-3000:]}" for r in self.replicas
        )


async def _serving(replica: Replica) -> None:
    """Wait for the replica's health to say SERVING (its Watch stream, not polling)."""
    async with asyncio.timeout(WAIT_S), grpc.aio.insecure_channel(replica.address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while True:
            try:
                async for answer in stub.Watch(health_pb2.HealthCheckRequest(service="")):
                    if answer.status == health_pb2.HealthCheckResponse.SERVING:
                        return
            except grpc.aio.AioRpcError as error:
                if replica.process.returncode is not None:
                    raise RuntimeError(replica.log.read_text(errors="replace")) from error
                await asyncio.sleep(0.2)  # not listening yet: nothing to await but time


@pytest.fixture
async def admission(redis_url: str, redis_prefix: str) -> AsyncIterator[GrpcService]:
    """The real admission service, its cap off (these tests count runtimes, not the cap)."""
    settings = admission_settings(
        redis_url,
        redis_prefix,
        client_allowlist=("acme",),
        shutdown_grace_s=1.0,
        cap={"default_cap": 100_000, "mode": "off"},
        rate={"default_burst": 100_000, "cluster_burst": 100_000},
        concurrency={"default_limit": 100_000},
    )
    async with running_admission(settings) as app:
        yield app


FleetFactory = Callable[..., contextlib.AbstractAsyncContextManager[Fleet]]


@pytest.fixture
def fleet(
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    admission: GrpcService,
    tmp_path: Path,
) -> FleetFactory:
    @contextlib.asynccontextmanager
    async def start(
        *,
        replicas: int = 3,
        kube: KubeEmulator | None = None,
        via: str | None = None,
        settings: dict[str, str] | None = None,
        pythonpath: str | None = None,
        **k8s: str,
    ) -> AsyncIterator[Fleet]:
        """``via``: the URL the replicas reach the test's database by (PgBouncer's), else
        the database's own; ``settings``: more ``TURNSTILE_*`` variables of the replicas;
        ``pythonpath``: source the replicas run instead of this checkout's."""
        await asyncio.to_thread(apply_migrations, database_url)
        emulator = kube or KubeEmulator(
            bookmark_interval=0.2,
            graceful_deletion=True,
            kubelet=KubeletConfig(start_delay=0.01, stop_delay=0.05),
            pod_security="restricted",
        )
        async with emulator:
            env = {
                key: value
                for key, value in os.environ.items()
                if not key.startswith(("TURNSTILE_", "OTEL_"))
            }
            env.update(
                {
                    "TURNSTILE_HOST": "127.0.0.1",
                    "TURNSTILE_PLAINTEXT": "true",  # loopback; mTLS has tests of its own
                    "TURNSTILE_METRICS_PORT": "0",
                    "TURNSTILE_LOG_FORMAT": "text",
                    "TURNSTILE_REDIS_URL": redis_url,
                    "TURNSTILE_REDIS_PREFIX": redis_prefix,
                    "TURNSTILE_CLIENT_ALLOWLIST": '["acme"]',
                    "TURNSTILE_DATABASE_URL": via or database_url,
                    "TURNSTILE_ADMISSION_ADDR": admission.address,
                    "TURNSTILE_SUBSTRATE_KIND": "kubernetes",
                    "TURNSTILE_SHUTDOWN_GRACE_S": "1",
                    "TURNSTILE_HEALTH_CHECK_INTERVAL_S": "0.2",
                    "TURNSTILE_K8S_API_HOST": emulator.url,
                    "TURNSTILE_K8S_NAMESPACE": NS,
                    "TURNSTILE_K8S_RELIST_BACKOFF_S": "0.05",
                    "TURNSTILE_K8S_RELIST_BACKOFF_MAX_S": "0.5",
                    "TURNSTILE_K8S_WARM_POOL_INTERVAL_S": "0.2",
                    "TURNSTILE_K8S_LEADER_LEASE_DURATION_S": str(LEASE_S),
                    "TURNSTILE_K8S_LEADER_RENEW_DEADLINE_S": str(RENEW_S),
                    "TURNSTILE_K8S_LEADER_RETRY_PERIOD_S": str(RETRY_S),
                    "TURNSTILE_K8S_SWEEP_INTERVAL_S": "0.5",
                    **{f"TURNSTILE_K8S_{key.upper()}": value for key, value in k8s.items()},
                    **(settings or {}),
                }
            )
            if pythonpath is not None:
                env["PYTHONPATH"] = pythonpath
            group = Fleet(emulator, database_url, env, tmp_path)
            try:
                await group.start(replicas)
                yield group
            except BaseException:
                print(group.output())
                raise
            finally:
                await group.stop()

    return start


def warm_pods(kube: KubeEmulator) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in kube.pods(NS)
        if LABEL_POOL in (p["metadata"].get("labels") or {})
        and not p["metadata"].get("deletionTimestamp")
    ]


class Recorder:
    """Counts committed pod events (what was really created or deleted)."""

    def __init__(self, kube: KubeEmulator) -> None:
        self.created: list[str] = []
        self.deleted: list[str] = []
        self.first_delete = asyncio.Event()
        self.first_create = asyncio.Event()
        kube.store.add_observer(self)

    def __call__(self, event: Event) -> None:
        name = event.pod.obj["metadata"]["name"]
        if event.type == ADDED:
            self.created.append(name)
            self.first_create.set()
        elif event.type == DELETED:
            self.deleted.append(name)
            self.first_delete.set()


async def _kill_leader_and_wait_for_the_next(group: Fleet) -> tuple[str, str, float]:
    old = group.holder()
    assert old is not None
    group.kill(group.replica(old))
    killed = time.monotonic()
    await group.until(lambda: group.holder() not in (None, old), timeout=WAIT_S)
    new = group.holder()
    assert new is not None
    return old, new, time.monotonic() - killed


@pytest.mark.parametrize("size", [pytest.param(12), pytest.param(60, marks=pytest.mark.slow)])
async def test_killing_the_leader_during_a_refill_makes_no_pod_storm(
    fleet: FleetFactory, size: int
) -> None:
    kube = KubeEmulator(
        bookmark_interval=0.2,
        graceful_deletion=True,
        kubelet=KubeletConfig(start_delay=0.01, stop_delay=0.05),
        pod_security="restricted",
    )
    # A slow API server: each create takes a while, so the kill lands mid-refill and the
    # leader's in-flight creates die with it.
    kube.delay_requests(0.3, method="POST", path=rf"/api/v1/namespaces/{NS}/pods")
    recorder = Recorder(kube)
    async with fleet(
        kube=kube, tier_runtimes=f'{{"default": {{"warm_pool_size": {size}}}}}'
    ) as group:
        await group.until(lambda: group.holder() is not None)
        await asyncio.wait_for(recorder.first_create.wait(), WAIT_S)
        before = len(recorder.created)

        old, new, took = await _kill_leader_and_wait_for_the_next(group)
        await group.until(lambda: len(warm_pods(kube)) >= size)
        # the new leader is alone and holds it
        assert sum(1 for r in group.replicas if r.process.returncode is None) == 2

    assert new != old
    assert took <= LEASE_S + RETRY_S + SLACK_S, took
    warm_created = [n for n in recorder.created if "-warm-" in n]
    assert len(warm_created) == len(set(warm_created))  # no duplicates
    assert len(warm_created) <= size + 1, (before, len(warm_created))  # no pod storm
    assert len(warm_pods(kube)) == size


def orphan(name: str, sandbox: str) -> dict[str, Any]:
    return pod_manifest(
        name,
        {LABEL_MANAGED_BY: MANAGED_BY, LABEL_SANDBOX_ID: sandbox, LABEL_TIER: "default"},
    )


def lost_pods(kube: KubeEmulator) -> list[str]:
    return [p["metadata"]["name"] for p in kube.pods(NS) if "-lost-" in p["metadata"]["name"]]


async def _record(database_url: str, sandbox: str, pod: str) -> None:
    conn = await asyncpg.connect(database_url)
    try:
        runtime = Runtime(sandbox, pod, CreateKind.COLD, "acme", "default")
        await records.record_activation(
            conn, runtime, substrate="kubernetes", charged_key="acme", receipt=None
        )
    finally:
        await conn.close()


@pytest.mark.parametrize("orphans", [pytest.param(10), pytest.param(60, marks=pytest.mark.slow)])
async def test_killing_the_leader_during_a_sweep_hands_it_over_and_spares_recorded_pods(
    fleet: FleetFactory, database_url: str, orphans: int
) -> None:
    kube = KubeEmulator(bookmark_interval=0.2, graceful_deletion=True)
    kube.delay_requests(0.2, method="DELETE", path=rf"/api/v1/namespaces/{NS}/pods/.*")
    await asyncio.to_thread(apply_migrations, database_url)
    async with kube:
        # Creates that landed after their clients timed out (no record), long ago ...
        for i in range(orphans):
            kube.create_pod(NS, orphan(f"ts-lost-{i}", f"lost-{i}"))
            kube.mutate_pod(
                NS,
                f"ts-lost-{i}",
                lambda p: p["metadata"].update(creationTimestamp="2020-01-01T00:00:00Z"),
            )
        # ... and one sandbox whose pod is recorded: it must survive.
        kube.create_pod(NS, orphan("ts-kept", "kept"))
        await _record(database_url, "kept", "ts-kept")
        recorder = Recorder(kube)
        async with fleet(kube=kube, sweep_orphan_grace_s="60") as group:
            await asyncio.wait_for(recorder.first_delete.wait(), WAIT_S)
            old, new, took = await _kill_leader_and_wait_for_the_next(group)
            await group.until(lambda: not lost_pods(kube))

    assert new != old
    assert took <= LEASE_S + RETRY_S + SLACK_S, took
    assert kube.pod(NS, "ts-kept") is not None
    assert sorted(recorder.deleted) == sorted(f"ts-lost-{i}" for i in range(orphans))


def _activate_call(
    channel: grpc.aio.Channel, sandbox: str, timeout: float
) -> Awaitable[substrate_pb2.ActivateResponse]:
    stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
    request = substrate_pb2.ActivateRequest(
        sandbox_id=sandbox, client=common_pb2.ActivationClient(client_id="acme")
    )
    return stub.Activate(request, timeout=timeout)


async def _activate(address: str, sandbox: str) -> substrate_pb2.ActivateResponse:
    async with grpc.aio.insecure_channel(address) as channel:
        for _ in range(20):
            try:
                return await _activate_call(channel, sandbox, timeout=30)
            except grpc.aio.AioRpcError as error:
                # Retryable answers, and the client's own timeout: retry as a client would
                # (the retry of a timed-out activation must find the same runtime, F5).
                if error.code() not in (
                    grpc.StatusCode.UNAVAILABLE,
                    grpc.StatusCode.DEADLINE_EXCEEDED,
                ):
                    raise
                await asyncio.sleep(0.2)
        raise AssertionError(f"activating {sandbox} kept failing")


async def _race_for_each_sandbox(
    group: Fleet, database_url: str, sandboxes: int, per_sandbox: int
) -> None:
    """``per_sandbox`` concurrent activations of each sandbox, spread over the replicas: exactly
    one runtime per sandbox, the one every call got, and every pod recorded."""
    addresses = [r.address for r in group.replicas]
    calls = [
        _activate(addresses[(s + k) % len(addresses)], f"sb-{s:03}")
        for s in range(sandboxes)
        for k in range(per_sandbox)
    ]
    started = time.monotonic()
    results = await asyncio.gather(*calls)
    print(f"{len(calls)} activations in {time.monotonic() - started:.1f} s")
    # let a few sweeps pass (every 0.5 s; the leader's renewals tick the emulator's
    # version as often): they must find nothing to remove
    before = group.kube.resource_version
    await group.until(lambda: group.kube.resource_version > before + 4)

    pods: dict[str, list[str]] = {}
    for pod in group.kube.pods(NS):
        sandbox = (pod["metadata"].get("labels") or {}).get(LABEL_SANDBOX_ID)
        if sandbox is not None and not pod["metadata"].get("deletionTimestamp"):
            pods.setdefault(sandbox, []).append(pod["metadata"]["name"])

    names = {r.sandbox.sandbox_id: r.sandbox.runtime_name for r in results}
    assert len(names) == sandboxes
    assert all(len(v) == 1 for v in pods.values()), pods  # exactly one runtime per sandbox
    assert {s: v[0] for s, v in pods.items()} == names  # and it is the one every call got
    conn = await asyncpg.connect(database_url)
    try:
        active = await records.active_runtimes(conn, "kubernetes")
        claims_left = await conn.fetchval("SELECT count(*) FROM activation_claims")
    finally:
        await conn.close()
    assert {a.sandbox_id: name for name, a in active.items()} == names  # no orphan, no gap
    assert claims_left == 0  # every claim released


@pytest.mark.parametrize(
    ("sandboxes", "per_sandbox"),
    [pytest.param(12, 3), pytest.param(100, 3, marks=pytest.mark.slow)],
)
async def test_concurrent_activations_over_three_replicas_make_one_runtime_per_sandbox(
    fleet: FleetFactory, database_url: str, sandboxes: int, per_sandbox: int
) -> None:
    async with fleet(
        tier_runtimes='{"default": {"warm_pool_size": 4}}', sweep_orphan_grace_s="30"
    ) as group:
        await group.until(lambda: len(warm_pods(group.kube)) >= 4)
        await _race_for_each_sandbox(group, database_url, sandboxes, per_sandbox)


async def test_concurrent_activations_over_two_replicas_behind_pgbouncer_transaction_mode(
    fleet: FleetFactory, database_url: str, pgbouncer_database_url: str
) -> None:
    """SPEC F7: the same race through a real PgBouncer in transaction mode whose pool (4
    server sessions) is smaller than the replicas' pools, so consecutive statements of one
    activation land on different sessions."""
    async with fleet(
        replicas=2,
        via=pgbouncer_database_url,
        settings={"TURNSTILE_DATABASE_STATEMENT_CACHE_SIZE": "0"},
        tier_runtimes='{"default": {"warm_pool_size": 2}}',
        sweep_orphan_grace_s="30",
    ) as group:
        await group.until(lambda: len(warm_pods(group.kube)) >= 2)
        await _race_for_each_sandbox(group, database_url, sandboxes=8, per_sandbox=3)


def _holds_ended() -> dict[str, float]:
    """Holds the in-process admission (it serves the fleet) has committed and cancelled."""
    from prometheus_client import REGISTRY

    return {
        action: REGISTRY.get_sample_value(
            "turnstile_admission_holds_total", {"action": action, "result": "done"}
        )
        or 0.0
        for action in ("commit", "cancel")
    }


@pytest.mark.parametrize("create_landed", [True, False], ids=["pod-made", "no-pod"])
async def test_a_replica_killed_mid_activation_leaves_one_runtime_once_another_takes_over(
    fleet: FleetFactory,
    database_url: str,
    redis: Any,
    redis_prefix: str,
    create_landed: bool,
) -> None:
    """SIGKILL a replica while its pod create is in flight (the API server holds the answer,
    having made the pod — or holds the request, making nothing); its claim lapses and the
    other replica's activation of the same sandbox takes over: exactly one runtime, one
    execution row, and only the survivor's hold committed (the dead one's expires)."""
    kube = KubeEmulator(
        bookmark_interval=0.2,
        graceful_deletion=True,
        kubelet=KubeletConfig(start_delay=0.01, stop_delay=0.05),
        pod_security="restricted",
    )
    pods_path = rf"/api/v1/namespaces/{NS}/pods"
    kube.delay_requests(120, method="POST", path=pods_path, after_write=create_landed)
    sandbox = "sb-kill"
    async with fleet(
        replicas=2, kube=kube, settings={"TURNSTILE_ACTIVATION_CLAIM_TTL_S": "2"}
    ) as group:
        doomed, survivor = group.replicas
        before = _holds_ended()
        first = asyncio.create_task(_activate_once(doomed.address, sandbox))
        await group.until(
            lambda: any(r.method == "POST" and r.path == pods_path for r in kube.requests)
        )
        if create_landed:
            await group.until(lambda: bool(_sandbox_pods(kube, sandbox)))
        group.kill(doomed)
        await doomed.process.wait()
        assert isinstance(await first, grpc.aio.AioRpcError)  # it died answering nothing
        kube.delay_requests(0, method="POST", path=pods_path)

        answer = await _activate(survivor.address, sandbox)
        pods = _sandbox_pods(kube, sandbox)
        after = _holds_ended()

    assert pods == [answer.sandbox.runtime_name]  # exactly one runtime: the one answered
    expected = (
        substrate_pb2.OUTCOME_ALREADY_RUNNING if create_landed else substrate_pb2.OUTCOME_CREATED
    )
    assert answer.outcome == expected  # adopted what the dead one made, or made it
    conn = await asyncpg.connect(database_url)
    try:
        executions = await conn.fetch(
            "SELECT runtime_name, ended_at FROM executions WHERE sandbox_id = $1", sandbox
        )
        claims_left = await conn.fetchval("SELECT count(*) FROM activation_claims")
    finally:
        await conn.close()
    assert [(e["runtime_name"], e["ended_at"]) for e in executions] == [(pods[0], None)]
    assert claims_left == 0
    # The survivor's hold (if it took one) was committed once; nobody cancelled the dead
    # replica's: it is still held, and expires on its own (SPEC X6).
    assert after["commit"] - before["commit"] == (0 if create_landed else 1)
    assert after["cancel"] == before["cancel"]
    holds = [key async for key in redis.scan_iter(match=f"{redis_prefix}*hold:*")]
    assert len(holds) == 1
    assert await redis.pttl(holds[0]) > 0  # it carries an expiry


async def _activate_once(address: str, sandbox: str) -> substrate_pb2.ActivateResponse | Exception:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            return await _activate_call(channel, sandbox, timeout=60)
        except grpc.aio.AioRpcError as error:
            return error


def _sandbox_pods(kube: KubeEmulator, sandbox: str) -> list[str]:
    return [
        p["metadata"]["name"]
        for p in kube.pods(NS)
        if (p["metadata"].get("labels") or {}).get(LABEL_SANDBOX_ID) == sandbox
        and not p["metadata"].get("deletionTimestamp")
    ]


async def _peak_connections(database_url: str, stop: asyncio.Event) -> tuple[int, int]:
    """Highest numbers of connections to the test's database seen while the run lasts: open
    (what PostgreSQL or PgBouncer must accept) and running a statement at that moment."""
    name = database_url.rsplit("/", 1)[-1]
    conn = await asyncpg.connect(database_url)
    peak_open = peak_active = 0
    try:
        while not stop.is_set():
            row = await conn.fetchrow(
                "SELECT count(*) AS open, count(*) FILTER (WHERE state <> 'idle') AS active"
                " FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
                name,
            )
            assert row is not None
            peak_open = max(peak_open, int(row["open"]))
            peak_active = max(peak_active, int(row["active"]))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 0.05)
    finally:
        await conn.close()
    return peak_open, peak_active


#: The last commit whose substrate held a PostgreSQL session advisory lock, and so a pooled
#: connection, for the whole of an activation (across Admit and the pod create).
ADVISORY_LOCK_COMMIT = "7bedb1c3b523858207d3be81bea842f08e41d150"


def _advisory_lock_design(directory: Path) -> str:
    """A ``PYTHONPATH`` that runs the substrate (and the libs it used) as of
    :data:`ADVISORY_LOCK_COMMIT`, extracted from git: the old design, run from its own
    code rather than kept alive in the service as a bench-only mode. Skips where the
    history is not there (an export, a shallow clone)."""
    root = Path(__file__).resolve().parents[2]
    trees = [
        "services/substrate/src",
        "libs/platform/src",
        "libs/clientkeys/src",
        "libs/contracts/src",
    ]
    archive = subprocess.run(
        ["git", "-C", str(root), "archive", ADVISORY_LOCK_COMMIT, *trees],
        capture_output=True,
        check=False,
    )
    if archive.returncode != 0:
        pytest.skip(f"commit {ADVISORY_LOCK_COMMIT[:12]} is not in this checkout's history")
    directory.mkdir(parents=True)
    subprocess.run(["tar", "-x", "-C", str(directory)], input=archive.stdout, check=True)
    return os.pathsep.join(str(directory / tree) for tree in trees)


async def _bench_cold_activations(
    group: Fleet, database_url: str, count: int, in_flight: int
) -> tuple[float, int, int]:
    """Activations per second of ``count`` new sandboxes, ``in_flight`` at a time, spread
    round robin over the replicas, and the peak connections while they ran."""
    addresses = [r.address for r in group.replicas]
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> None:
        async with gate:
            await _activate(addresses[i % len(addresses)], f"bench-{i:04}")

    stop = asyncio.Event()
    peak = asyncio.create_task(_peak_connections(database_url, stop))
    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(count)))
    elapsed = time.perf_counter() - started
    stop.set()
    peak_open, peak_active = await peak
    return count / elapsed, peak_open, peak_active


@pytest.mark.benchmark
async def test_bench_cold_activations_per_second_against_the_advisory_lock_design(
    fleet: FleetFactory, database_url: str, tmp_path: Path
) -> None:
    """Cold activations per second through 1 and 3 replicas (300 activations, 64 in flight,
    spread round robin, admission's cap off), and PostgreSQL connections at peak, for the
    activation claims and for the session advisory lock they replaced, in the same run; then
    one replica with a pool of 4 connections, where the old design can have only 4
    activations in progress. ``-m benchmark -s`` prints the table."""
    count, in_flight = 300, 64
    designs = {
        "advisory lock": _advisory_lock_design(tmp_path / "advisory-lock"),
        "claims": None,
    }
    runs = [(design, replicas, 20) for design in designs for replicas in (1, 3)]
    runs += [(design, 1, 4) for design in designs]
    await asyncio.to_thread(apply_migrations, database_url)
    lines = []
    for design, replicas, pool in runs:
        conn = await asyncpg.connect(database_url)
        try:  # the same empty tables for every run
            await conn.execute("TRUNCATE sandboxes, executions, receipts, activation_claims")
        finally:
            await conn.close()
        async with fleet(
            replicas=replicas,
            pythonpath=designs[design],
            # Budgets for a loaded machine: they are not what is measured, and a replica
            # whose Redis check spends 0.5 s waiting for a CPU would never report SERVING.
            settings={
                "TURNSTILE_DATABASE_POOL_MAX": str(pool),
                "TURNSTILE_REDIS_TIMEOUT_S": "5",
                "TURNSTILE_RPC_TIMEOUT_S": "10",
            },
        ) as group:
            rate, peak_open, peak_active = await _bench_cold_activations(
                group, database_url, count, in_flight
            )
        lines.append(
            f"| {design} | {replicas} | {pool} | {rate:.0f} | {peak_open} | {peak_active} "
            f"| {os.getloadavg()[0]:.1f} |"
        )
        print(lines[-1], flush=True)
    print(
        "\n| design | replicas | pool | cold activations/s | peak connections open | peak"
        " not idle | load |\n|---|---|---|---|---|---|---|\n" + "\n".join(lines)
    )
