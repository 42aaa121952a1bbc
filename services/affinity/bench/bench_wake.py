"""Wake benchmark: from a session's first ``SANDBOX_PENDING`` to its next ``HIT``.

    uv run python services/affinity/bench/bench_wake.py [--rounds 8] [--poll-ms 20]
        [--substrate direct,kubernetes]

``direct`` runs the real local stack (``turnstilectl up``: admission, substrate
on the Direct substrate, affinity, each its own process, the worker agent as
each sandbox's runtime, forked from the preloaded launcher). ``kubernetes``
runs the same three services as processes with the substrate on the
Kubernetes substrate against the test kit's API-server emulator (in this
process), with a stand-in kubelet here that marks each new sandbox pod
Running at once and starts, for it, a fresh ``turnstile-worker`` process (as
the pod's container would; no preloading), stopped when the pod goes. Both
use the test Redis and a fresh PostgreSQL database, and export spans over OTLP
to the test kit's receiver. One sandbox serves one session; each round
deactivates the sandbox, waits until its worker is gone, then ``Place``s every
``--poll-ms`` until ``HIT`` (the way a client retries a pending answer), and
times the wake from the first pending answer.

The split by stage comes from the trace (server spans, wall clock):

- ``trigger``: the pending ``Place`` began → substrate ``Activate`` began
  (affinity's background wake, one gRPC hop);
- ``activate``: the substrate's ``Activate`` (admission, credential, spawn),
  of which ``admit`` is the ``Admit`` call;
- ``worker_start``: ``Activate`` ended → the woken worker's ``Attach`` stream
  began at affinity (interpreter start-up or fork, imports, connect); negative
  when the worker attached before ``Activate`` answered;
- ``to_hit``: ``Attach`` began → the client saw ``HIT`` (Hello, Welcome,
  presence, and the client's next poll).

``--prepare-leads 0,0.5,2`` measures instead what ``Prepare`` (SPEC W2) buys a turn:
each round, for each mode in turn (no ``Prepare``, then ``Prepare`` sent each lead time
before the turn), the sandbox is deactivated and gone, the gateway's ``Prepare`` is sent
(not in the no-``Prepare`` mode), and after the lead time the turn's first ``Place`` is
sent, then retried every ``--poll-ms`` until ``HIT``: the turn's latency runs from that
first ``Place`` to the ``HIT``. Modes interleave round by round, so every mode sees the
same machine; the output adds each mode's p50 / p99 and its p50 as a ratio of the
no-``Prepare`` p50 of the same run (``{"prepare": [...]}``).

Output: one line per round, then a JSON object ``{"wake": [...]}`` with one
entry per substrate (stable keys: ``substrate``, ``rounds``, ``p50_s``,
``p99_s``, ``stages`` with each stage's p50/p99 in seconds, ``load``).
Environment: ``TURNSTILE_TEST_REDIS_URL`` / ``TURNSTILE_TEST_DATABASE_URL``
(defaults: the local Redis and PostgreSQL).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack, asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import grpc.aio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider

from turnstile_contracts import (
    affinity_pb2,
    affinity_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform import peers
from turnstile_platform.errors import decode
from turnstile_platform.health_check import wait_serving
from turnstile_platform.sandbox_credentials import generate_key_pair
from turnstile_platform.tracing import client_interceptors
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kube_emulator.kubelet import mark_running
from turnstile_testing.otlp import OtlpReceiver, ReceivedSpan
from turnstile_testing.processes import free_port
from turnstile_testing.stack import run_stack

PLACE = "/turnstile.affinity.v1.AffinityService/Place"
ATTACH = "/turnstile.affinity.v1.AffinityService/Attach"
ACTIVATE = "/turnstile.substrate.v1.SubstrateService/Activate"
ADMIT = "/turnstile.admission.v1.AdmissionService/Admit"
SERVER, CLIENT = 2, 3  # OTLP span kinds
STAGES = ("trigger", "activate", "admit", "worker_start", "to_hit")
SANDBOX, SESSION = "bench-wake-sb", "bench-wake-chat"
NAMESPACE = "sandboxes"
LABEL_SANDBOX_ID = "turnstile.dev/sandbox-id"
BIN = Path(sys.executable).parent


@dataclass
class Round:
    trace_id: str
    pending_ns: int  # wall clock when the first pending answer came back
    hit_ns: int  # wall clock when the HIT came back
    polls: int

    @property
    def wake_s(self) -> float:
        return (self.hit_ns - self.pending_ns) / 1e9


async def _until(probe: Callable[[], Awaitable[bool]], interval_s: float, timeout_s: float) -> None:
    """Poll another process's state: no event crosses the process boundary."""
    async with asyncio.timeout(timeout_s):
        while not await probe():  # noqa: ASYNC110 - the state is in other processes
            await asyncio.sleep(interval_s)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def _stages(rnd: Round, spans: list[ReceivedSpan]) -> dict[str, float]:
    """The round's stage durations (s) from its trace and the Attach span that followed."""

    def one(name: str, kind: int) -> ReceivedSpan:
        found = [
            s for s in spans if s.trace_id == rnd.trace_id and s.name == name and s.kind == kind
        ]
        if len(found) != 1:
            raise RuntimeError(f"{name}: {len(found)} spans in round {rnd.trace_id}")
        return found[0]

    place = min(
        (s for s in spans if s.trace_id == rnd.trace_id and s.name == PLACE and s.kind == SERVER),
        key=lambda s: s.start_ns,
    )
    activate = one(ACTIVATE, SERVER)
    admit = one(ADMIT, SERVER)
    attach = min(
        (
            s
            for s in spans
            if s.name == ATTACH and s.kind == SERVER and s.start_ns >= activate.start_ns
        ),
        key=lambda s: s.start_ns,
    )
    return {
        "trigger": (activate.start_ns - place.start_ns) / 1e9,
        "activate": (activate.end_ns - activate.start_ns) / 1e9,
        "admit": (admit.end_ns - admit.start_ns) / 1e9,
        "worker_start": (attach.start_ns - activate.end_ns) / 1e9,
        "to_hit": (rnd.hit_ns - attach.start_ns) / 1e9,
    }


async def _rounds(
    affinity: affinity_pb2_grpc.AffinityServiceAsyncStub,
    substrate: substrate_pb2_grpc.SubstrateServiceAsyncStub,
    tracer: trace.Tracer,
    rounds: int,
    poll_s: float,
) -> list[Round]:
    async def present() -> bool:
        listed = await affinity.ListWorkers(affinity_pb2.ListWorkersRequest())
        return any(w.sandbox_id == SANDBOX for w in listed.workers)

    async def absent() -> bool:
        return not await present()

    await substrate.Activate(
        substrate_pb2.ActivateRequest(
            sandbox_id=SANDBOX, client=common_pb2.ActivationClient(client_id="bench")
        )
    )
    await _until(present, poll_s, 60)
    first = await affinity.Place(affinity_pb2.PlaceRequest(client_id="bench", session_id=SESSION))
    await affinity.ReleaseLease(
        affinity_pb2.ReleaseLeaseRequest(sandbox_id=first.sandbox_id, lease_id=first.lease_id)
    )
    done: list[Round] = []
    for index in range(rounds):
        await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=SANDBOX))
        await _until(absent, poll_s, 60)
        with tracer.start_as_current_span(f"wake round {index}") as root:
            trace_id = format(root.get_span_context().trace_id, "032x")
            pending_ns = 0
            polls = 0
            async with asyncio.timeout(60):
                while True:
                    polls += 1
                    try:
                        hit = await affinity.Place(
                            affinity_pb2.PlaceRequest(client_id="bench", session_id=SESSION)
                        )
                    except grpc.aio.AioRpcError as raw:
                        reason = decode(raw).reason
                        if reason != "SANDBOX_PENDING":
                            raise RuntimeError(f"Place answered {reason}") from raw
                        if not pending_ns:
                            pending_ns = time.time_ns()
                        await asyncio.sleep(poll_s)
                        continue
                    hit_ns = time.time_ns()
                    break
        if not pending_ns:
            raise RuntimeError("the sandbox was back before the first Place: no wake measured")
        await affinity.ReleaseLease(
            affinity_pb2.ReleaseLeaseRequest(sandbox_id=hit.sandbox_id, lease_id=hit.lease_id)
        )
        rnd = Round(trace_id, pending_ns, hit_ns, polls)
        print(f"round {index}: {rnd.wake_s * 1000:.0f} ms ({polls} polls)", flush=True)
        done.append(rnd)
    # Ends the last Attach stream, so its span is exported too.
    await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=SANDBOX))
    await _until(absent, poll_s, 60)
    return done


async def _turn(
    affinity: affinity_pb2_grpc.AffinityServiceAsyncStub, poll_s: float
) -> tuple[float, int]:
    """The turn's latency: its first ``Place`` sent → ``HIT`` received (s), and its polls."""
    start = time.perf_counter()
    polls = 0
    async with asyncio.timeout(60):
        while True:
            polls += 1
            try:
                hit = await affinity.Place(
                    affinity_pb2.PlaceRequest(client_id="bench", session_id=SESSION)
                )
            except grpc.aio.AioRpcError as raw:
                reason = decode(raw).reason
                if reason != "SANDBOX_PENDING":
                    raise RuntimeError(f"Place answered {reason}") from raw
                await asyncio.sleep(poll_s)
                continue
            latency = time.perf_counter() - start
            break
    await affinity.ReleaseLease(
        affinity_pb2.ReleaseLeaseRequest(sandbox_id=hit.sandbox_id, lease_id=hit.lease_id)
    )
    return latency, polls


async def _prepare_rounds(
    affinity: affinity_pb2_grpc.AffinityServiceAsyncStub,
    substrate: substrate_pb2_grpc.SubstrateServiceAsyncStub,
    rounds: int,
    poll_s: float,
    leads: list[float | None],
) -> dict[float | None, list[float]]:
    """Each round, each mode (None: no Prepare; else the lead time in s): the turn's latency
    after its sandbox went away."""

    async def present() -> bool:
        listed = await affinity.ListWorkers(affinity_pb2.ListWorkersRequest())
        return any(w.sandbox_id == SANDBOX for w in listed.workers)

    async def absent() -> bool:
        return not await present()

    await substrate.Activate(
        substrate_pb2.ActivateRequest(
            sandbox_id=SANDBOX, client=common_pb2.ActivationClient(client_id="bench")
        )
    )
    await _until(present, poll_s, 60)
    await _turn(affinity, poll_s)  # the session's first turn: its record names the sandbox
    done: dict[float | None, list[float]] = {lead: [] for lead in leads}
    for index in range(rounds):
        for lead in leads:
            await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=SANDBOX))
            await _until(absent, poll_s, 60)
            if lead is not None:
                prepared = await affinity.Prepare(
                    affinity_pb2.PrepareRequest(client_id="bench", session_id=SESSION)
                )
                if prepared.outcome != affinity_pb2.PREPARE_OUTCOME_WAKE_STARTED:
                    name = affinity_pb2.PrepareOutcome.Name(prepared.outcome)
                    raise RuntimeError(f"Prepare answered {name}")
                await asyncio.sleep(lead)
            latency, polls = await _turn(affinity, poll_s)
            mode = "no Prepare" if lead is None else f"Prepare {lead:g} s ahead"
            print(f"round {index}, {mode}: {latency * 1000:.0f} ms ({polls} polls)", flush=True)
            done[lead].append(latency)
    await substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id=SANDBOX))
    return done


async def measure_prepare(
    substrate: str, rounds: int, poll_s: float, workdir: Path | None, leads: list[float]
) -> dict[str, object]:
    redis_url = os.environ.get("TURNSTILE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    postgres_url = os.environ.get(
        "TURNSTILE_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
    )
    database_url, drop = await _fresh_database(postgres_url)
    modes: list[float | None] = [None, *leads]
    try:
        with tempfile.TemporaryDirectory(prefix="bench-wake-") as tmp:
            where = workdir / substrate if workdir is not None else Path(tmp)
            where.mkdir(parents=True, exist_ok=True)
            prefix = f"bench-wake:{uuid.uuid4().hex[:8]}:"
            setup = Setup(redis_url, prefix, database_url, {}, where)
            async with (
                STACKS[substrate](setup) as (substrate_addr, affinity_addr, creds),
                _channel(substrate_addr, creds) as sub,
                _channel(affinity_addr, creds) as aff,
            ):
                done = await _prepare_rounds(
                    affinity_pb2_grpc.AffinityServiceStub(aff),
                    substrate_pb2_grpc.SubstrateServiceStub(sub),
                    rounds,
                    poll_s,
                    modes,
                )
    finally:
        await drop()
    baseline = statistics.median(done[None])
    return {
        "substrate": substrate,
        "rounds": rounds,
        "modes": [
            {
                "lead_s": lead,
                "p50_s": round(statistics.median(done[lead]), 4),
                "p99_s": round(_percentile(done[lead], 0.99), 4),
                "p50_vs_no_prepare": round(statistics.median(done[lead]) / baseline, 3),
            }
            for lead in modes
        ],
        "load": list(os.getloadavg()),
    }


async def _fresh_database(postgres_url: str) -> tuple[str, Callable[[], Awaitable[None]]]:
    name = f"bench_wake_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(postgres_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()

    async def drop() -> None:
        admin = await asyncpg.connect(postgres_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()

    return f"{postgres_url.rsplit('/', 1)[0]}/{name}", drop


@dataclass
class Setup:
    redis_url: str
    redis_prefix: str
    database_url: str
    exporting: dict[str, str]
    workdir: Path
    preload: bool = True

    @property
    def extra_env(self) -> dict[str, str]:
        if self.preload:
            return self.exporting
        return {**self.exporting, "TURNSTILE_DIRECT_RUNTIME_PRELOAD": ""}


@asynccontextmanager
async def _direct(setup: Setup) -> AsyncIterator[tuple[str, str, grpc.ChannelCredentials | None]]:
    """The local stack (``turnstilectl up``); yields (substrate, affinity) addresses and the
    stack's mTLS client credentials (an operator's)."""
    with run_stack(
        setup.workdir,
        redis_url=setup.redis_url,
        redis_prefix=setup.redis_prefix,
        database_url=setup.database_url,
        grace_s=60.0,
        extra_env=setup.extra_env,
    ) as stack:
        await stack.wait_serving(timeout_s=90)
        _, substrate_addr, affinity_addr = stack.addresses
        yield substrate_addr, affinity_addr, stack.credentials()
        await asyncio.to_thread(stack.interrupt)


class Kubelet:
    """Stands in for the scheduler and kubelet: each new sandbox pod is marked Running
    at once and gets a fresh worker agent process; a pod that goes stops its worker."""

    def __init__(self, kube: KubeEmulator, affinity_addr: str, log: Path) -> None:
        self._kube = kube
        self._affinity_addr = affinity_addr
        self._log = log
        self._workers: dict[str, subprocess.Popen[bytes]] = {}
        #: each pod's credential file, written once its Secret exists (the kubelet's
        #: projection of the Secret volume; the worker waits for the file)
        self._credentials: dict[str, Path] = {}

    async def run(self) -> None:
        while True:  # the emulator is in this process: a 5 ms scan costs little
            live: set[str] = set()
            for pod in self._kube.pods(NAMESPACE):
                meta: dict[str, Any] = pod["metadata"]
                if meta.get("deletionTimestamp"):
                    continue
                name = meta["name"]
                live.add(name)
                if name not in self._workers:
                    self._kube.mutate_pod(NAMESPACE, name, mark_running)
                    self._workers[name] = self._start(name, meta["labels"][LABEL_SANDBOX_ID])
                self._project(name)
            for name in set(self._workers) - live:
                self._workers.pop(name).send_signal(signal.SIGTERM)
                self._credentials.pop(name).unlink(missing_ok=True)
            await asyncio.sleep(0.005)

    def _project(self, pod_name: str) -> None:
        """Write the pod's credential file from its Secret, once the Secret exists."""
        path = self._credentials[pod_name]
        if path.exists():
            return
        secret = self._kube.secret(NAMESPACE, f"{pod_name}-credential")
        if secret is not None:
            path.write_text(base64.b64decode(secret["data"]["credential"]).decode())

    def _start(self, pod_name: str, sandbox_id: str) -> subprocess.Popen[bytes]:
        credential = self._log.parent / f"{pod_name}.credential"
        self._credentials[pod_name] = credential
        env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
        env.update(
            TURNSTILE_WORKER_CREDENTIAL_FILE=str(credential),
            TURNSTILE_WORKER_SANDBOX_ID=sandbox_id,
            TURNSTILE_WORKER_TIER="",
            TURNSTILE_AFFINITY_ADDR=self._affinity_addr,
            TURNSTILE_PLAINTEXT="true",
            TURNSTILE_LOG_FORMAT="text",
        )
        with self._log.open("ab") as out:
            return subprocess.Popen(
                [str(BIN / "turnstile-worker")], env=env, stdout=out, stderr=subprocess.STDOUT
            )

    def close(self) -> None:
        for worker in self._workers.values():
            worker.send_signal(signal.SIGTERM)
        for worker in self._workers.values():
            worker.wait(timeout=30)


def _migrate(env: dict[str, str], log: Path) -> None:
    with log.open("ab") as out:
        subprocess.run(
            [str(BIN / "turnstile-migrate")],
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            check=True,
        )


def _spawn(command: str, env: dict[str, str], log: Path) -> subprocess.Popen[bytes]:
    with log.open("ab") as out:
        return subprocess.Popen([str(BIN / command)], env=env, stdout=out, stderr=subprocess.STDOUT)


@asynccontextmanager
async def _kubernetes(
    setup: Setup,
) -> AsyncIterator[tuple[str, str, grpc.ChannelCredentials | None]]:
    """The three services as processes, the substrate on the emulator; yields
    (substrate, affinity) addresses (plaintext: no credentials)."""
    ports = {name: free_port() for name in ("admission", "substrate", "affinity")}
    addr = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
    common = {
        **base,
        **setup.exporting,
        "TURNSTILE_HOST": "127.0.0.1",
        # Loopback development: plaintext must be asked for (mTLS is the default).
        "TURNSTILE_PLAINTEXT": "true",
        "TURNSTILE_METRICS_PORT": "0",
        "TURNSTILE_REDIS_URL": setup.redis_url,
        "TURNSTILE_REDIS_PREFIX": setup.redis_prefix,
        "TURNSTILE_DATABASE_URL": setup.database_url,
        "TURNSTILE_ADMISSION_ADDR": addr["admission"],
        "TURNSTILE_SUBSTRATE_ADDR": addr["substrate"],
        "TURNSTILE_AFFINITY_ADDR": addr["affinity"],
        "TURNSTILE_LOG_FORMAT": "text",
        "TURNSTILE_SHUTDOWN_GRACE_S": "3",
    }
    await asyncio.to_thread(_migrate, common, setup.workdir / "migrate.log")
    # Attestation on, as deployed: the substrate mints each pod's credential into a Secret,
    # the stand-in kubelet projects it, and the relay learns the sandbox's owner from it.
    signing, public = setup.workdir / "signing.pem", setup.workdir / "public.pem"
    generate_key_pair(signing, public)
    async with AsyncExitStack() as stack:
        kube = await stack.enter_async_context(KubeEmulator(bookmark_interval=0.2))
        own = {
            "substrate": {
                "TURNSTILE_SUBSTRATE_KIND": "kubernetes",
                "TURNSTILE_K8S_API_HOST": kube.url,
                "TURNSTILE_K8S_NAMESPACE": NAMESPACE,
                "TURNSTILE_WORKER_CREDENTIAL_SIGNING_KEY_FILE": str(signing),
            },
            "admission": {},
            "affinity": {
                "TURNSTILE_GRACE_S": "60",
                "TURNSTILE_WORKER_ATTESTATION": "enforce",
                "TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE": str(public),
            },
        }
        procs = [
            _spawn(
                f"turnstile-{name}",
                {**common, **own[name], "TURNSTILE_PORT": str(port)},
                setup.workdir / f"{name}.log",
            )
            for name, port in ports.items()
        ]
        try:
            services = {"admission": peers.ADMISSION, "substrate": peers.SUBSTRATE}
            services["affinity"] = peers.AFFINITY
            for name, service in services.items():
                if not await wait_serving(addr[name], timeout_s=90, service=service):
                    raise RuntimeError(f"{name} did not come up: see {setup.workdir}")
            kubelet = Kubelet(kube, addr["affinity"], setup.workdir / "workers.log")
            running = asyncio.create_task(kubelet.run())
            try:
                yield addr["substrate"], addr["affinity"], None
            finally:
                running.cancel()
                await asyncio.gather(running, return_exceptions=True)
                await asyncio.to_thread(kubelet.close)
        finally:
            for proc in procs:
                proc.send_signal(signal.SIGINT)
            for proc in procs:
                await asyncio.to_thread(proc.wait, 30)


STACKS = {"direct": _direct, "kubernetes": _kubernetes}


def _channel(
    address: str, credentials: grpc.ChannelCredentials | None, **kwargs: Any
) -> grpc.aio.Channel:
    if credentials is None:
        return grpc.aio.insecure_channel(address, **kwargs)
    return grpc.aio.secure_channel(address, credentials, **kwargs)


async def measure(
    substrate: str, rounds: int, poll_s: float, workdir: Path | None, *, preload: bool = True
) -> dict[str, object]:
    redis_url = os.environ.get("TURNSTILE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")
    postgres_url = os.environ.get(
        "TURNSTILE_TEST_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/postgres"
    )
    database_url, drop = await _fresh_database(postgres_url)
    receiver = await OtlpReceiver().start()
    provider = TracerProvider()
    tracer = provider.get_tracer("bench-wake")
    exporting = {
        "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_BSP_SCHEDULE_DELAY": "100",
    }
    try:
        with tempfile.TemporaryDirectory(prefix="bench-wake-") as tmp:
            where = workdir / substrate if workdir is not None else Path(tmp)
            where.mkdir(parents=True, exist_ok=True)
            prefix = f"bench-wake:{uuid.uuid4().hex[:8]}:"
            setup = Setup(redis_url, prefix, database_url, exporting, where, preload)
            async with STACKS[substrate](setup) as (substrate_addr, affinity_addr, creds):
                interceptors = client_interceptors(provider)
                async with (
                    _channel(substrate_addr, creds, interceptors=interceptors) as sub,
                    _channel(affinity_addr, creds, interceptors=interceptors) as aff,
                ):
                    done = await _rounds(
                        affinity_pb2_grpc.AffinityServiceStub(aff),
                        substrate_pb2_grpc.SubstrateServiceStub(sub),
                        tracer,
                        rounds,
                        poll_s,
                    )

                def complete(spans: list[ReceivedSpan]) -> bool:
                    attaches = sum(1 for s in spans if s.name == ATTACH and s.kind == SERVER)
                    # Each service exports on its own schedule: wait for every one.
                    activated = {
                        s.trace_id for s in spans if s.name == ACTIVATE and s.kind == SERVER
                    }
                    admitted = {s.trace_id for s in spans if s.name == ADMIT and s.kind == SERVER}
                    return attaches >= rounds + 1 and all(
                        r.trace_id in activated and r.trace_id in admitted for r in done
                    )

                spans = await receiver.wait_for(complete, timeout=60)
    finally:
        await receiver.stop()
        await drop()
    return _summary(substrate, done, spans)


def _summary(substrate: str, done: list[Round], spans: list[ReceivedSpan]) -> dict[str, object]:
    walls = [r.wake_s for r in done]
    staged = [_stages(r, spans) for r in done]
    for index, split in enumerate(staged):
        parts = ", ".join(f"{k} {v * 1000:.0f}" for k, v in split.items())
        print(f"round {index} stages (ms): {parts}", flush=True)
    return {
        "substrate": substrate,
        "rounds": len(done),
        "p50_s": round(statistics.median(walls), 4),
        "p99_s": round(_percentile(walls, 0.99), 4),
        "stages": {
            stage: {
                "p50_s": round(statistics.median(s[stage] for s in staged), 4),
                "p99_s": round(_percentile([s[stage] for s in staged], 0.99), 4),
            }
            for stage in STAGES
        },
        "load": list(os.getloadavg()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--poll-ms", type=float, default=20.0)
    parser.add_argument("--substrate", default="direct,kubernetes")
    parser.add_argument(
        "--no-preload",
        action="store_true",
        help="direct: start each runtime from its command, without the preloaded launcher",
    )
    parser.add_argument(
        "--workdir", type=Path, help="keep the stack's logs and runtime logs here (default: temp)"
    )
    parser.add_argument(
        "--prepare-leads",
        metavar="S,S,...",
        help="measure a turn after Prepare sent these many seconds ahead, against none",
    )
    args = parser.parse_args()
    if args.prepare_leads:
        leads = [float(v) for v in args.prepare_leads.split(",")]
        prepared = []
        for name in args.substrate.split(","):
            found = asyncio.run(
                measure_prepare(name, args.rounds, args.poll_ms / 1000, args.workdir, leads)
            )
            print(json.dumps(found), flush=True)  # each substrate's as soon as it is known
            prepared.append(found)
        print(json.dumps({"prepare": prepared}))
        return
    results = [
        asyncio.run(
            measure(
                name, args.rounds, args.poll_ms / 1000, args.workdir, preload=not args.no_preload
            )
        )
        for name in args.substrate.split(",")
    ]
    print(json.dumps({"wake": results}))


if __name__ == "__main__":
    main()
