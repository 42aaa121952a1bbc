"""Measured isolation (SPEC N4): one tenant's floods against another tenant's calls.

    uv run python services/substrate/bench/bench_noisy_neighbour.py [--runs 3] [--phase-s 3]

The three services run as real processes (``python -m turnstile_<service>``) on
loopback over mutual TLS, each with its own server certificate and the shipped
policy's shape; the callers present tenant certificates (``client/acme`` the
attacker, ``client/globex`` the victim), the gateway's (``service/gateway``), the
affinity relay's (``service/affinity``, for a wake) and the substrate's
(``service/substrate``, for a warm refill's ``ReserveWarm``). The substrate is Direct.

The attacker runs in a process of its own (this script with ``--attack``), so its
client-side work does not slow the victim's measuring loop. For each attack a
quiet phase and an attack phase of ``--phase-s`` are measured in turn; in each the
victim runs one loop per call — ``Activate`` of its running sandbox, ``GetUsage``,
``ListDecisions`` of its own client, and the gateway's ``Place`` of a victim
session — and the platform's own calls run beside it: a wake (``Activate``
``inherit`` of a stopped victim sandbox, as the relay sends it), a warm refill's
``ReserveWarm`` (then ``CancelHold``), and the live-count publish (the age of the
substrate leader's ``live-state`` marker in Redis, sampled: it is a write, not a call).

The attacks, each bounded in count and by the phase: the same-id ``Activate``
flood (1,100 calls of one sandbox with a wait budget and ``queue_per_client``
while the attacker's concurrency is 0); a ``ListDecisions`` scan flood (8 in
flight, a sandbox filter matching nothing, after the log was filled by a third
tenant's refusals); a refused-``Activate`` flood (16 in flight, distinct ids);
4 MB messages (8 in flight); 2,000 waiting calls on distinct ids.

Reported per attack: the victim's p99 per call, attack ÷ quiet; the victim's
answers that were refusals the quiet phase did not see (caused by the attacker);
the platform calls' p99 ratio and failures, and the marker's largest age; the
attacker's calls by answer, and how many ``RESOURCE_EXHAUSTED`` answers name its
flow (an ``ErrorInfo`` metadata entry whose key says ``flow`` and whose value names
``acme``; a refusal by the attacker's own limits names its key, not its flow).
With ``--runs`` above 1, each ratio's median and range. The goals (p99 ≤ 2×, no victim refusal, the
platform unaffected, the attacker refused naming its flow) are printed as met
or not; nothing fails. Takes about a minute per run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import grpc.aio
import redis.asyncio as aioredis
from google.protobuf.duration_pb2 import Duration
from google.protobuf.message import Message

from turnstile_clientkeys.limits import LimitsStore
from turnstile_contracts import admission_pb2, affinity_pb2, common_pb2, substrate_pb2
from turnstile_platform.errors import decode
from turnstile_platform.health_check import wait_serving
from turnstile_platform.sandbox_credentials import generate_key_pair
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_testing.pki import Identity, Pki
from turnstile_testing.processes import free_port

TD = "spiffe://turnstile.test"
ADMISSION = "turnstile.admission.v1.AdmissionService"
SUBSTRATE = "turnstile.substrate.v1.SubstrateService"
AFFINITY = "turnstile.affinity.v1.AffinityService"
IDLE_RUNTIME = f"{sys.executable} -m turnstile_substrate.direct.idle_runtime"
POLICY = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/service/substrate"]
methods = ["{ADMISSION}/*"]
clients = "any"

[[allow]]
identities = ["{TD}/service/affinity"]
methods = ["{SUBSTRATE}/Activate", "{SUBSTRATE}/GetSandbox"]
clients = "any"

[[allow]]
identities = ["{TD}/service/gateway"]
methods = ["{AFFINITY}/Place", "{AFFINITY}/Prepare", "{AFFINITY}/GetSession"]
clients = "any"

[[allow]]
identities = ["{TD}/operator/*"]
methods = ["*"]
clients = "any"

[[allow]]
identities = ["{TD}/client/*"]
methods = [
  "{SUBSTRATE}/Activate", "{SUBSTRATE}/Deactivate", "{SUBSTRATE}/GetSandbox",
  "{ADMISSION}/GetUsage", "{ADMISSION}/GetQueuePosition", "{ADMISSION}/ListDecisions",
]
clients = "self"
"""
RESPONSES: dict[str, type[Message]] = {
    "Activate": substrate_pb2.ActivateResponse,
    "Deactivate": substrate_pb2.DeactivateResponse,
    "GetUsage": admission_pb2.GetUsageResponse,
    "ListDecisions": admission_pb2.ListDecisionsResponse,
    "ReserveWarm": admission_pb2.ReserveWarmResponse,
    "CancelHold": admission_pb2.CancelHoldResponse,
    "Place": affinity_pb2.PlaceResponse,
}
ATTACKS = ("same_id_flood", "scan_flood", "refused_flood", "big_messages", "waiting_distinct")
#: Answers that refuse a call for want of something shared (or of time).
REFUSALS = frozenset({"RESOURCE_EXHAUSTED", "UNAVAILABLE", "ABORTED", "DEADLINE_EXCEEDED"})
FILL_ENTRIES = 2_000


def client(client_id: str) -> common_pb2.ActivationClient:
    return common_pb2.ActivationClient(client_id=client_id)


class Caller:
    """Unary calls as one identity, to the three services."""

    def __init__(self, identity: Identity, addresses: dict[str, str]) -> None:
        self._channels = {
            name: grpc.aio.secure_channel(
                address,
                identity.credentials(),
                options=[
                    ("grpc.max_send_message_length", 8 * 1024 * 1024),
                    ("grpc.max_receive_message_length", 8 * 1024 * 1024),
                ],
            )
            for name, address in addresses.items()
        }

    async def call(
        self, service: str, method: str, request: Message, timeout_s: float = 10.0
    ) -> tuple[str, Any]:
        """(status code name, response or decoded error)."""
        name = service.rsplit(".", 1)[-1].removesuffix("Service").lower()
        rpc = self._channels[name].unary_unary(
            f"/{service}/{method}",
            request_serializer=type(request).SerializeToString,
            response_deserializer=RESPONSES[method].FromString,
        )
        try:
            return "OK", await rpc(request, timeout=timeout_s)
        except grpc.aio.AioRpcError as error:
            return error.code().name, decode(error)

    async def close(self) -> None:
        for channel in self._channels.values():
            await channel.close(None)


# -- the services, as processes ----------------------------------------------------


def env_of(values: dict[str, Any]) -> dict[str, str]:
    """``TURNSTILE_*`` variables of settings values (nested groups with ``__``)."""
    env: dict[str, str] = {}
    for key, value in values.items():
        name = f"TURNSTILE_{key.upper()}"
        if isinstance(value, dict) and key in {"cap", "rate", "concurrency", "queue"}:
            for inner, item in value.items():
                env[f"{name}__{inner.upper()}"] = str(item)
        elif isinstance(value, bool):
            env[name] = "true" if value else "false"
        elif isinstance(value, (list, tuple, dict)):
            env[name] = json.dumps(list(value) if isinstance(value, tuple) else value)
        else:
            env[name] = str(value)
    return env


class Services:
    """admission, substrate and affinity as processes over mTLS; stopped by ``stop``."""

    def __init__(self, pki: Pki, work: Path, database_url: str, redis_url: str) -> None:
        self.prefix = f"noisy-{uuid.uuid4().hex[:8]}:"
        self.ports = {name: free_port() for name in ("admission", "substrate", "affinity")}
        self.addresses = {name: f"127.0.0.1:{port}" for name, port in self.ports.items()}
        self._processes: list[subprocess.Popen[bytes]] = []
        self.logs = work / "logs"
        self.logs.mkdir(parents=True)
        keys = (work / "signing.pem", work / "public.pem")
        generate_key_pair(*keys)
        worker = pki.identity("sandbox")
        self.state_dir = work / "direct"
        common = {
            "host": "127.0.0.1",
            "metrics_port": 0,
            "redis_url": redis_url,
            "redis_prefix": self.prefix,
            "log_format": "text",
            "shutdown_grace_s": 0.5,
            "admission_addr": self.addresses["admission"],
            "substrate_addr": self.addresses["substrate"],
            "affinity_addr": self.addresses["affinity"],
        }
        self.settings: dict[str, dict[str, Any]] = {
            "admission": {
                **common,
                "port": self.ports["admission"],
                "client_allowlist": ("acme", "globex", "initech"),
                "cap": {"default_cap": 10_000},
                "rate": {"default_burst": 1_000_000, "cluster_burst": 1_000_000},
                "concurrency": {"default_limit": 10_000},
                **pki.server_settings("service/admission", policy=POLICY),
            },
            "substrate": {
                **common,
                "port": self.ports["substrate"],
                "database_url": database_url,
                "database_pool_max": 20,
                "substrate_kind": "direct",
                "direct_runtime_command": IDLE_RUNTIME,
                "direct_runtime_user": str(os.getuid()),
                "direct_state_dir": self.state_dir,
                "direct_stop_grace_s": 2.0,
                "worker_credential_signing_key_file": keys[0],
                "direct_worker_tls_cert_file": worker.cert_file,
                "direct_worker_tls_key_file": worker.key_file,
                **pki.server_settings("service/substrate", policy=POLICY),
            },
            "affinity": {
                **common,
                "port": self.ports["affinity"],
                "worker_credential_public_keys_file": keys[1],
                **pki.server_settings("service/affinity", policy=POLICY),
            },
        }
        self._ops = pki.identity("operator/ops").credentials()

    async def start(self) -> None:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
        for name in ("admission", "substrate", "affinity"):
            env = {**base, "OTEL_TRACES_EXPORTER": "none", **env_of(self.settings[name])}
            with (self.logs / f"{name}.log").open("ab") as out:
                process = await asyncio.to_thread(
                    subprocess.Popen,
                    [sys.executable, "-m", f"turnstile_{name}"],
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                )
                self._processes.append(process)
            if not await wait_serving(self.addresses[name], timeout_s=90, credentials=self._ops):
                raise RuntimeError(f"{name} did not come up:\n{self.log(name)}")

    def log(self, name: str) -> str:
        return (self.logs / f"{name}.log").read_text(errors="replace")[-4000:]

    def cpu_s(self) -> dict[str, float]:
        """Each service process's CPU seconds so far (user + system, /proc)."""
        found: dict[str, float] = {}
        ticks = os.sysconf("SC_CLK_TCK")
        names = ("admission", "substrate", "affinity")
        for name, process in zip(names, self._processes, strict=True):
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
            found[name] = (int(fields[11]) + int(fields[12])) / ticks
        return found

    async def stop(self) -> None:
        for process in reversed(self._processes):
            process.terminate()
        for process in reversed(self._processes):
            try:
                await asyncio.to_thread(process.wait, 15)
            except subprocess.TimeoutExpired:
                process.kill()
        # Direct runtimes outlive their substrate by design: ours go with the run.
        root = str(self.state_dir.absolute())
        for entry in os.scandir("/proc"):
            if not entry.name.isdigit():
                continue
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{entry.name}/cwd").startswith(root + os.sep):
                    os.killpg(int(entry.name), signal.SIGKILL)


# -- the attacker (its own process) -------------------------------------------------


async def attack(name: str, config: dict[str, Any], duration_s: float) -> dict[str, Any]:
    """Run one attack as ``client/acme`` for ``duration_s``; its answers by code, and
    how many RESOURCE_EXHAUSTED ones name the attacker's flow."""
    pki_dir = Path(config["pki"])
    identity = Identity(
        spiffe_id=None,
        cert_file=pki_dir / config["acme"]["cert"],
        key_file=pki_dir / config["acme"]["key"],
        ca_file=pki_dir / "ca.crt",
    )
    acme = Caller(identity, config["addresses"])
    codes: Counter[str] = Counter()
    naming_flow = 0
    loop = asyncio.get_running_loop()
    end = loop.time() + duration_s

    def waiting(sandbox_id: str) -> substrate_pb2.ActivateRequest:
        return substrate_pb2.ActivateRequest(
            sandbox_id=sandbox_id,
            client=client("acme"),
            wait_budget=Duration(seconds=60),
            queue_per_client=True,
        )

    async def one(service: str, method: str, request: Message, timeout_s: float) -> None:
        nonlocal naming_flow
        code, answer = await acme.call(service, method, request, timeout_s)
        reason = getattr(answer, "reason", "")
        codes[f"{code}/{reason}" if reason else code] += 1
        metadata = getattr(answer, "metadata", {})
        if code == "RESOURCE_EXHAUSTED" and any(
            "flow" in k and "acme" in str(v) for k, v in metadata.items()
        ):
            naming_flow += 1

    async def loop_until_end(make: Callable[[int], tuple[str, str, Message]]) -> None:
        n = 0
        while loop.time() < end and n < 100_000:
            service, method, request = make(n)
            await one(service, method, request, max(0.1, end - loop.time()))
            n += 1

    async def fired_once(requests: list[Message]) -> None:
        calls = [
            # A long deadline, so that the substrate passes the wait budget on.
            asyncio.ensure_future(one(SUBSTRATE, "Activate", r, 90))
            for r in requests
        ]
        await asyncio.sleep(duration_s)
        for call in calls:
            call.cancel()
        left = await asyncio.gather(*calls, return_exceptions=True)
        codes["WAITING_AT_END"] += sum(isinstance(r, asyncio.CancelledError) for r in left)

    tag = uuid.uuid4().hex[:6]
    if name == "same_id_flood":
        await fired_once([waiting("acme--flooded") for _ in range(1_100)])
    elif name == "waiting_distinct":
        await fired_once([waiting(f"acme--w{tag}{n}") for n in range(2_000)])
    elif name == "scan_flood":
        scan = admission_pb2.ListDecisionsRequest(
            client_id="acme", sandbox_id="acme--nothing", limit=500
        )
        await asyncio.gather(
            *(loop_until_end(lambda n: (ADMISSION, "ListDecisions", scan)) for _ in range(8))
        )
    elif name == "refused_flood":

        def refused(n: int, worker: int) -> tuple[str, str, Message]:
            request = substrate_pb2.ActivateRequest(
                sandbox_id=f"acme--r{tag}{worker}x{n}", client=client("acme")
            )
            return SUBSTRATE, "Activate", request

        await asyncio.gather(
            *(loop_until_end(lambda n, w=w: refused(n, w)) for w in range(16))  # type: ignore[misc]
        )
    elif name == "big_messages":
        big = substrate_pb2.ActivateRequest(
            sandbox_id="acme--big", client=client("acme"), tier="x" * (4 * 1024 * 1024 - 4096)
        )
        await asyncio.gather(
            *(loop_until_end(lambda n: (SUBSTRATE, "Activate", big)) for _ in range(8))
        )
    await acme.close()
    return {"codes": dict(codes), "naming_flow": naming_flow}


# -- the victim and the platform ----------------------------------------------------


class Phase:
    """What one phase measured."""

    def __init__(self) -> None:
        self.latencies: dict[str, list[float]] = {}
        self.codes: dict[str, Counter[str]] = {}
        self.marker_age_s = 0.0
        self.attacker: dict[str, Any] = {}

    def add(self, what: str, seconds: float, code: str) -> None:
        self.latencies.setdefault(what, []).append(seconds)
        self.codes.setdefault(what, Counter())[code] += 1

    def p99(self, what: str) -> float:
        values = sorted(self.latencies.get(what, [0.0]))
        return values[min(len(values) - 1, int(0.99 * len(values)))]


VICTIM = ("Activate (running)", "GetUsage", "ListDecisions", "Place (gateway)")
PLATFORM = ("wake", "ReserveWarm")


class Bench:
    def __init__(self, services: Services, pki: Pki, redis: aioredis.Redis) -> None:
        addresses = services.addresses
        self.services = services
        self.redis = redis
        self.globex = Caller(pki.identity("client/globex"), addresses)
        self.gateway = Caller(pki.identity("service/gateway"), addresses)
        self.relay = Caller(pki.identity("service/affinity"), addresses)
        self.refill = Caller(pki.identity("service/substrate"), addresses)
        self.ops = Caller(pki.identity("operator/ops"), addresses)
        self.initech = Caller(pki.identity("client/initech"), addresses)
        self._victim_calls: dict[str, Callable[[], Awaitable[tuple[str, Any]]]] = {
            "Activate (running)": lambda: self.globex.call(
                SUBSTRATE,
                "Activate",
                substrate_pb2.ActivateRequest(sandbox_id="globex--run", client=client("globex")),
            ),
            "GetUsage": lambda: self.globex.call(
                ADMISSION, "GetUsage", admission_pb2.GetUsageRequest(client=client("globex"))
            ),
            "ListDecisions": lambda: self.globex.call(
                ADMISSION,
                "ListDecisions",
                admission_pb2.ListDecisionsRequest(client_id="globex", limit=20),
            ),
            "Place (gateway)": lambda: self.gateway.call(
                AFFINITY,
                "Place",
                affinity_pb2.PlaceRequest(session_id="globex-chat", client_id="globex"),
            ),
        }

    async def prepare(self) -> None:
        limits = LimitsStore(self.redis, self.services.prefix)
        for key in ("key:acme", "key:initech"):
            await limits.put(key, {"concurrency": 0})
        for sandbox_id in ("globex--run", "globex--sleep"):
            code, answer = await self.globex.call(
                SUBSTRATE,
                "Activate",
                substrate_pb2.ActivateRequest(sandbox_id=sandbox_id, client=client("globex")),
                timeout_s=30,
            )
            assert code == "OK", answer
        # The decision log a scan reads through: another tenant's refusals.
        sem = asyncio.Semaphore(16)

        async def refused(n: int) -> None:
            async with sem:
                await self.initech.call(
                    SUBSTRATE,
                    "Activate",
                    substrate_pb2.ActivateRequest(
                        sandbox_id=f"initech--f{n}", client=client("initech")
                    ),
                )

        await asyncio.gather(*(refused(n) for n in range(FILL_ENTRIES)))

    async def phase(self, duration_s: float, attack_name: str | None, config: Path) -> Phase:
        measured = Phase()
        loop = asyncio.get_running_loop()
        attacker: asyncio.subprocess.Process | None = None
        if attack_name is not None:
            attacker = await asyncio.create_subprocess_exec(
                sys.executable,
                __file__,
                "--attack",
                attack_name,
                "--config",
                str(config),
                "--phase-s",
                str(duration_s),
                stdout=asyncio.subprocess.PIPE,
            )
            await asyncio.sleep(0.5)  # the attacker's process starting and connecting
        end = loop.time() + duration_s - (0.5 if attacker else 0.0)
        # The wake's sandbox is stopped before each phase, so each wake restores it.
        await self.ops.call(
            SUBSTRATE, "Deactivate", substrate_pb2.DeactivateRequest(sandbox_id="globex--sleep")
        )

        async def victim(what: str) -> None:
            call = self._victim_calls[what]
            while loop.time() < end:
                started = time.perf_counter()
                code, _ = await call()
                measured.add(what, time.perf_counter() - started, code)

        async def platform() -> None:
            woken = False
            n = 0
            while loop.time() < end:
                if not woken:
                    started = time.perf_counter()
                    code, _ = await self.relay.call(
                        SUBSTRATE,
                        "Activate",
                        substrate_pb2.ActivateRequest(
                            sandbox_id="globex--sleep",
                            client=common_pb2.ActivationClient(
                                inherit=common_pb2.ActivationClient.Inherit()
                            ),
                        ),
                        timeout_s=30,
                    )
                    measured.add("wake", time.perf_counter() - started, code)
                    woken = True
                started = time.perf_counter()
                code, answer = await self.refill.call(
                    ADMISSION,
                    "ReserveWarm",
                    admission_pb2.ReserveWarmRequest(tier="default", pod_name=f"warm-{n}"),
                )
                measured.add("ReserveWarm", time.perf_counter() - started, code)
                if code == "OK" and answer.hold_id:
                    await self.refill.call(
                        ADMISSION,
                        "CancelHold",
                        admission_pb2.CancelHoldRequest(hold_id=answer.hold_id),
                    )
                n += 1
                await asyncio.sleep(0.2)

        async def marker() -> None:
            key = f"{self.services.prefix}{{adm}}:live-state"
            ttl_s = 5.0
            while loop.time() < end:
                left_ms = await self.redis.pttl(key)
                if left_ms > 0:
                    measured.marker_age_s = max(measured.marker_age_s, ttl_s - left_ms / 1000)
                await asyncio.sleep(0.05)

        await asyncio.gather(*(victim(w) for w in VICTIM), platform(), marker())
        if attacker is not None:
            out, _ = await attacker.communicate()
            measured.attacker = json.loads(out.decode() or "{}")
        return measured

    async def close(self) -> None:
        for caller in (self.globex, self.gateway, self.relay, self.refill, self.ops, self.initech):
            await caller.close()


def ratio(attack: Phase, quiet: Phase, what: str) -> float:
    return attack.p99(what) / max(quiet.p99(what), 1e-6)


def caused_refusals(attack: Phase, quiet: Phase, what: str) -> int:
    """Refusal answers in the attack phase of a kind the quiet phase never gave."""
    seen = quiet.codes.get(what, Counter())
    return sum(
        n
        for code, n in attack.codes.get(what, Counter()).items()
        if code in REFUSALS and code not in seen
    )


def report(results: dict[str, list[tuple[Phase, Phase]]]) -> None:
    def spread(values: list[float]) -> str:
        if len(values) == 1:
            return f"{values[0]:.2f}"
        return f"{statistics.median(values):.2f} ({min(values):.2f}–{max(values):.2f})"

    print("\nvictim p99 attack ÷ quiet (median and range over runs), refusals caused")
    header = f"{'attack':<18}" + "".join(f"{w:>22}" for w in (*VICTIM, *PLATFORM))
    print(header + f"{'marker age s':>14}")
    goals: dict[str, list[bool]] = {"p99": [], "victim": [], "platform": [], "flow": []}
    for name, runs in results.items():
        row = f"{name:<18}"
        for what in (*VICTIM, *PLATFORM):
            ratios = [ratio(a, q, what) for q, a in runs]
            refused = sum(caused_refusals(a, q, what) for q, a in runs)
            row += f"{spread(ratios) + f' /{refused}':>22}"
            if what in VICTIM:
                goals["p99"].append(max(ratios) <= 2.0)
                goals["victim"].append(refused == 0)
            else:
                goals["platform"].append(refused == 0 and max(ratios) <= 2.0)
        ages = [a.marker_age_s for _, a in runs]
        quiet_ages = [q.marker_age_s for q, _ in runs]
        goals["platform"].append(max(ages) <= max(quiet_ages) + 1.0)
        print(row + f"{max(ages):>8.1f} (q {max(quiet_ages):.1f})")
    print("\nattacker answers (summed over runs); RESOURCE_EXHAUSTED naming its flow")
    for name, runs in results.items():
        codes: Counter[str] = Counter()
        naming = 0
        for _, attack in runs:
            codes.update(attack.attacker.get("codes", {}))
            naming += attack.attacker.get("naming_flow", 0)
        exhausted = sum(n for c, n in codes.items() if c.startswith("RESOURCE_EXHAUSTED"))
        goals["flow"].append(exhausted == 0 or naming == exhausted)
        print(f"  {name:<18} {dict(codes.most_common())}  naming flow: {naming}/{exhausted}")
    print("\nvictim calls per phase (quiet / attack), first run")
    for name, runs in results.items():
        quiet, attack = runs[0]
        counts = "  ".join(
            f"{w}: {len(quiet.latencies.get(w, []))}/{len(attack.latencies.get(w, []))}"
            for w in VICTIM
        )
        print(f"  {name:<18} {counts}")
    print("\ngoals (SPEC N4):")
    words = {
        "p99": "victim p99 ≤ 2× quiet",
        "victim": "no victim refusal caused by the attacker",
        "platform": "platform calls unaffected (p99 ≤ 2×, no refusal, marker renewed)",
        "flow": "attacker's RESOURCE_EXHAUSTED name its flow",
    }
    for goal, met in goals.items():
        print(f"  {'met    ' if all(met) else 'NOT met'}  {words[goal]}")


async def main(args: argparse.Namespace) -> None:
    base, _, _ = args.database_url.rpartition("/")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(args.database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = f"{base}/{name}"
    work = Path(tempfile.mkdtemp(prefix="turnstile-noisy-"))
    redis = aioredis.from_url(args.redis_url)
    results: dict[str, list[tuple[Phase, Phase]]] = {a: [] for a in args.attacks}
    try:
        await asyncio.to_thread(apply_migrations, url)
        pki = Pki(work / "pki")
        acme = pki.identity("client/acme")
        config = work / "attacker.json"
        for run in range(args.runs):
            services = Services(pki, work / f"run{run}", url, args.redis_url)
            await services.start()
            config.write_text(
                json.dumps(
                    {
                        "pki": str(pki.directory),
                        "acme": {
                            "cert": str(acme.cert_file.relative_to(pki.directory)),
                            "key": str(acme.key_file.relative_to(pki.directory)),
                        },
                        "addresses": services.addresses,
                    }
                )
            )
            bench = Bench(services, pki, redis)
            try:
                await bench.prepare()
                for attack_name in args.attacks:
                    quiet = await bench.phase(args.phase_s, None, config)
                    attacked = await bench.phase(args.phase_s, attack_name, config)
                    results[attack_name].append((quiet, attacked))
                    print(
                        f"run {run + 1} {attack_name}: done (load {os.getloadavg()[0]:.1f},"
                        f" service CPU s {services.cpu_s()})",
                        flush=True,
                    )
            finally:
                await bench.close()
                await services.stop()
                async for key in redis.scan_iter(match=f"{services.prefix}*", count=1000):
                    await redis.delete(key)
        report(results)
    finally:
        await redis.aclose()
        with contextlib.suppress(Exception):
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()


def cli() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n", 1)[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--phase-s", type=float, default=3.0)
    parser.add_argument("--attacks", nargs="*", default=list(ATTACKS), choices=ATTACKS)
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    parser.add_argument("--redis-url", default="redis://127.0.0.1:6379/0")
    parser.add_argument("--attack", choices=ATTACKS, help=argparse.SUPPRESS)
    parser.add_argument("--config", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.attack:
        config = json.loads(args.config.read_text())
        print(json.dumps(asyncio.run(attack(args.attack, config, args.phase_s - 0.5))))
        return
    asyncio.run(main(args))


if __name__ == "__main__":
    cli()
