"""Admit throughput and latency beside two ceilings measured in the same run.

    uv run python services/admission/bench/bench_admit.py [--seconds 3] [--only alternating]

Every server runs in its own process on 127.0.0.1 (uvloop), the load comes from
this process over one channel, all against a private redis-server of the run's
own (so INFO commandstats counts only this benchmark):

* echo     — a grpc.aio server that returns the request: the gRPC ceiling;
* evalsha  — a grpc.aio server whose handler runs one small EVALSHA: the ceiling
             of anything that does one Redis round trip per call;
* platform — the evalsha handler behind the platform's ``GrpcService`` (the
             platform interceptor every service pays, tracing with the same sampler);
* admit    — the admission service, COLD_CREATE with every policy enforced
             (cap with the live count read from the key's live set in Redis,
             marked current as a substrate leader marks it; rate, concurrency,
             node slots), and RESUME (concurrency only). Limits are set high so
             every call takes the full path.

Tracing stays on: admission exports its spans over OTLP/gRPC to a sink in this
run (``otlp``, which answers every export with an empty response), with the
sampler the production overlay sets (``--sampler``/``--sampler-arg``, default
parent-based 10 %; the bench's calls carry no trace context, so every Admit is a
root and the ratio applies). A second admission process samples 100 %: it runs
the cold create once in the table, then both alternate at 64 in flight, so the
cost of tracing everything is measured in the same run with drift falling on both.

Each is measured at 1 and 64 calls in flight: calls/s, p50 and p99, and the
server process's CPU time per call (user + system, from ``/proc``: unlike calls/s
it hardly moves when other processes load the machine, so its ratios are the
steadier measure of what a service's own code costs). Admit is reported as a
ratio of each ceiling; Redis commands per decision come from the
INFO commandstats delta over the Admit runs. A stub substrate still listens at
admission's substrate address and counts the ``CountLiveSandboxes`` calls it gets
(in Redis, so they would show in commandstats too): a decision should make none.
The run ends with one line of JSON with stable keys (``--json PATH`` writes it
to a file too) so runs can be compared across commits.

After the table, alternating rounds (``--alt-rounds``, 3 by default; 0 skips
them): per round and per shape (cold, resume, resume_commit below), the EVALSHA
ceiling then the shape at 64 in flight, then the ceiling then the shape at 1,
``--seconds / 2`` each; the order of the shapes is reversed every other round.
Reported per shape, as median, min and max over the rounds (JSON
``alternating.cold`` and ``alternating.resume``):

* ``rps_64_per_evalsha``        calls/s at 64 in flight ÷ the ceiling phase's;
* ``p50_1_per_evalsha_p50``     p50 at 1 in flight ÷ the ceiling phase's;
* ``server_cpu_64_per_evalsha`` server CPU per call at 64 ÷ the ceiling server's;
* ``server_cpu_us_per_call_64``, ``redis_cpu_us_per_call_64``, ``rps_64``,
  ``p50_ms_1``: each side's own figure (``evalsha``, ``admit``); Redis's is its
  main thread's CPU per call over the phase (``INFO cpu``).

The rounds also run the production mix, ``resume_commit`` (JSON
``alternating.resume_commit``; informational, not one of the performance goals): in
production every Admit is followed by a CommitHold or a CancelHold, one EVALSHA
each, so a service serves two methods in turn. Each of the 64 (or 1) turns in
flight is a resume Admit then the CommitHold of the hold it got, beside a ceiling
phase whose turns are two one-EVALSHA calls, so the ratios are per RPC against
the same ceiling. The commit releases the hold's lease, so the mix never piles
leases up against the concurrency limit, whatever the run's length. Its keys:

* ``rps_64_per_evalsha``, ``server_cpu_64_per_evalsha``: as above (per turn and
  per RPC are the same ratio, two RPCs a turn on either side);
* ``p50_1_per_evalsha_p50``     p50 of one turn at 1 in flight ÷ two ceiling calls';
* ``server_cpu_us_per_rpc_64``, ``redis_cpu_us_per_rpc_64``, ``rpcs_per_s_64``,
  ``turn_p50_ms_1``: each side's own figure, per RPC (the p50 per turn);
* ``evalsha_per_rpc``           scripts Redis ran (``INFO commandstats``: EVALSHA,
                                EVAL, SCRIPT LOAD) per RPC over the mix's phases
                                (1.000 expected), ``rpcs`` the RPCs counted;
* ``not_admitted``, ``not_committed``: turns whose Admit was not ADMITTED, or whose
  CommitHold found no hold, over the run (0 expected; any spoils the figures).

Beside them ``alternating.rounds``, ``.seconds_per_phase`` and ``.load_avg_1m``
(before and after), and in ``goals`` the medians of the three goal ratios,
keyed as the single pass's with ``_alternating`` appended. The goals line prints
both, "single pass | alternating median". The mix's medians are keyed likewise
under ``informational`` (``resume_commit_64_per_evalsha_alternating``,
``resume_commit_1_p50_per_evalsha_p50_alternating``,
``cpu_resume_commit_64_per_evalsha_alternating``, ``resume_commit_evalsha_per_rpc``)
and printed on a line of their own, not among the goals.

**Judge the performance goals by the alternating medians**: in the single pass the
ceilings are measured once at the start and the Admit runs a minute or more
later, against a Redis those runs have filled with holds, so each ratio also
carries the machine's drift over that minute (the same code read 0.56-0.80 from
run to run); in the rounds each ratio compares two phases seconds apart against
the same Redis, the order of shapes is reversed every other round so cold and
resume swap places, and the median shrugs off one disturbed phase.
``--only alternating`` runs the rounds alone (evalsha ceiling, stub substrate,
OTLP sink and one admission process; the JSON then holds ``alternating``, the
``_alternating`` goals, ``informational``, ``load_avg_1m``, ``sampler``): about
70 s by default, of which the mix's phases are 18 (three rounds of four 1.5 s
phases), for quick A/B checks between commits.

Also two figures measured inside one process: the authorization check alone,
and the platform interceptor alone (CPU per call around a handler that returns at
once, against that handler called bare, with the production sampler and tracing
everything).

Then COLD_CREATE again under transport security (SPEC Z1, Z2), each a fresh
admission process, to price mTLS and the authorization check separately:

* mtls       — mutual TLS on the client's and the substrate hop's channels, with
               the authorization check replaced by a pass-through (a
               bench-only patch: the service itself cannot run mTLS without it);
* mtls+authz — the same with the real policy (deploy's), called as the substrate
               identity (``clients = "any"``: method check only);
* mtls+self  — called as ``client/acme`` allowed ``self``: the client id is read
               from the request and checked too.

The four run as separate processes side by side and are measured in interleaved
rounds (``--rounds``, 3 by default). Reported: the median per-round ratio and its
range, mtls / plaintext (the TLS cost) and each authorization mode / mtls (the
authorization cost; goal within 5 %).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import redis.asyncio as aioredis
import uvloop

from turnstile_clientkeys import LiveCountKeys
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform import tls
from turnstile_platform.pki import ensure_local_pki
from turnstile_testing.authz import without_authorization
from turnstile_testing.processes import RedisProcess, free_port, port_open

REPO = Path(__file__).resolve().parents[3]
POLICY = REPO / "deploy/kustomize/base/authz-policy.toml"
#: The bench's extra rule: a tenant identity may Admit for itself (the ``self`` path).
SELF_RULE = """
[[allow]]
identities = ["spiffe://turnstile.local/client/*"]
methods = ["turnstile.admission.v1.AdmissionService/Admit"]
clients = "self"
"""
HOLDERS = {
    "admission": "service/admission",
    "substrate": "service/substrate",
    "acme": "client/acme",
}
SECURE_MODES = ("mtls", "mtls+authz", "mtls+self")

ECHO = "/bench.Echo/Echo"
#: The sampler deploy/kustomize/overlays/production sets (tests/deploy checks they agree).
PRODUCTION_SAMPLER, PRODUCTION_SAMPLER_ARG = "parentbased_traceidratio", "0.1"
BYTES: Callable[[bytes], bytes] = lambda b: b  # noqa: E731


# --- servers (run as subprocesses) ------------------------------------------------


async def serve_echo(port: int, redis_url: str) -> None:
    async def echo(request: bytes, context: Any) -> bytes:
        return request

    await _serve(port, echo)


async def serve_evalsha(port: int, redis_url: str) -> None:
    client = aioredis.Redis.from_url(redis_url)
    script = client.register_script("return redis.call('INCR', KEYS[1])")

    async def one_evalsha(request: bytes, context: Any) -> bytes:
        await script(keys=["bench:{adm}:ceiling"], args=[])
        return request

    await _serve(port, one_evalsha)


async def serve_platform(port: int, redis_url: str) -> None:
    """The EVALSHA handler behind the platform's GrpcService (tracing with the
    admission's sampler, RPC metrics, call limits, rich errors, decoding): what
    every service pays before its own code runs."""
    from turnstile_admission.settings import AdmissionSettings
    from turnstile_platform.server import GrpcService

    client = aioredis.Redis.from_url(redis_url)
    script = client.register_script("return redis.call('INCR', KEYS[1])")

    async def one_evalsha(request: bytes, context: Any) -> bytes:
        await script(keys=["bench:{adm}:ceiling"], args=[])
        return request

    settings = AdmissionSettings(port=0, metrics_port=0)
    await _serve(port, one_evalsha, GrpcService("bench", settings, service_names=[]).server)


async def _serve(port: int, behaviour: Any, server: grpc.aio.Server | None = None) -> None:
    server = server or grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        behaviour, request_deserializer=BYTES, response_serializer=BYTES
    )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


COUNT_CALLS = "bench:{adm}:count-live-calls"


class StubSubstrate(substrate_pb2_grpc.SubstrateServiceServicer):
    """Answers CountLiveSandboxes (live 0) and counts the calls it gets."""

    def __init__(self, redis_url: str) -> None:
        self._redis = aioredis.Redis.from_url(redis_url)

    async def CountLiveSandboxes(self, request: Any, context: Any) -> Any:  # noqa: N802
        await self._redis.incr(COUNT_CALLS)
        return substrate_pb2.CountLiveSandboxesResponse(
            known=substrate_pb2.CountLiveSandboxesResponse.Known(live=0)
        )


async def serve_substrate(port: int, redis_url: str) -> None:
    server = grpc.aio.server()
    substrate_pb2_grpc.add_SubstrateServiceServicer_to_server(StubSubstrate(redis_url), server)  # type: ignore[abstract]
    if tls_dir := os.environ.get("BENCH_TLS_DIR"):
        files = _files(Path(tls_dir), "substrate")
        server.add_secure_port(f"127.0.0.1:{port}", tls.server_credentials(files))
    else:
        server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


def _files(directory: Path, holder: str) -> tls.TlsFiles:
    return tls.TlsFiles(
        directory / f"{holder}.crt", directory / f"{holder}.key", directory / "ca.crt"
    )


def serve_admission(unchecked: bool) -> None:
    """The admission service as ``turnstile-admission`` runs it (settings from the
    environment), optionally with authorization replaced by a pass-through."""
    if unchecked:
        without_authorization()
    from turnstile_admission.__main__ import main

    main()


OTLP_EXPORT = "/opentelemetry.proto.collector.trace.v1.TraceService/Export"


async def serve_otlp(port: int, redis_url: str) -> None:
    """An OTLP trace sink: every export succeeds (an empty response is a valid one)."""

    async def export(request: bytes, context: Any) -> bytes:
        return b""

    server = grpc.aio.server()
    handler = grpc.unary_unary_rpc_method_handler(
        export, request_deserializer=BYTES, response_serializer=BYTES
    )
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "opentelemetry.proto.collector.trace.v1.TraceService", {"Export": handler}
            ),
        )
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    await server.wait_for_termination()


SERVERS = {
    "echo": serve_echo,
    "evalsha": serve_evalsha,
    "substrate": serve_substrate,
    "otlp": serve_otlp,
    "platform": serve_platform,
}


# --- load ---------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def measure(
    call: Callable[[], Awaitable[Any]],
    in_flight: int,
    seconds: float,
    pid: int | None = None,
    redis: aioredis.Redis | None = None,
    warm_up: int = 200,
) -> dict[str, float]:
    """calls/s, p50 and p99 of ``call`` with ``in_flight`` at once, after
    ``warm_up`` calls one at a time (connections, script cache, caches); with the
    server's ``pid``, also its CPU time per call; with ``redis``, Redis's
    main-thread CPU time per call."""
    for _ in range(warm_up):
        await call()
    cpu_before = cpu_seconds(pid) if pid is not None else 0.0
    redis_before = await redis_cpu_s(redis) if redis is not None else 0.0
    latencies: list[float] = []
    deadline = time.perf_counter() + seconds

    async def worker() -> None:
        while time.perf_counter() < deadline:
            started = time.perf_counter()
            await call()
            latencies.append(time.perf_counter() - started)

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(in_flight)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    out = {
        "calls": len(latencies),
        "rps": len(latencies) / elapsed,
        "p50_ms": statistics.median(latencies) * 1000,
        "p99_ms": latencies[int(len(latencies) * 0.99)] * 1000,
    }
    if pid is not None:
        out["cpu_us"] = (cpu_seconds(pid) - cpu_before) / len(latencies) * 1e6
    if redis is not None:
        out["redis_cpu_us"] = (await redis_cpu_s(redis) - redis_before) / len(latencies) * 1e6
    return out


def _admit(stub: Any, make: Callable[[], Any]) -> Callable[[], Awaitable[Any]]:
    return lambda: stub.Admit(make())


def spawn(
    kind: str, port: int, redis_url: str, env: dict[str, str] | None = None
) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(
        [sys.executable, __file__, "--serve", kind, str(port), redis_url],
        env={**os.environ, **(env or {})},
    )
    _wait(port)
    return proc


def _wait(port: int) -> None:
    deadline = time.monotonic() + 60  # a loaded 2-core machine starts a service slowly
    while not port_open("127.0.0.1", port):
        if time.monotonic() > deadline:
            raise TimeoutError(f"nothing listens on {port}")
        time.sleep(0.05)


async def commandstats(client: aioredis.Redis) -> dict[str, int]:
    info = await client.info("commandstats")
    return {k.removeprefix("cmdstat_"): int(v["calls"]) for k, v in info.items()}


async def script_usec(client: aioredis.Redis) -> int:
    """Microseconds Redis spent running EVALSHA so far (the script's own time).

    Wall time: on a loaded machine it counts every moment redis-server was
    descheduled mid-script, so it grows with the load (see :func:`redis_cpu_s`)."""
    info = await client.info("commandstats")
    return int(info.get("cmdstat_evalsha", {}).get("usec", 0))


async def redis_cpu_s(client: aioredis.Redis) -> float:
    """CPU seconds of Redis's main thread so far (user + system): parsing, scripts
    and replies. Unlike commandstats' time it hardly moves with the machine's load."""
    cpu = await client.info("cpu")
    return float(cpu["used_cpu_user_main_thread"]) + float(cpu["used_cpu_sys_main_thread"])


@dataclass
class Options:
    """What to run (``main``'s flags)."""

    seconds: float
    rounds: int
    alt_rounds: int
    only: str | None
    sampler: str
    sampler_arg: str
    json_path: str | None


def admission_env(ports: dict[str, int], redis_url: str, opts: Options) -> dict[str, str]:
    """The environment of the admission under test (and of the ``platform`` ceiling)."""
    return {
        **os.environ,
        "TURNSTILE_PORT": str(ports["admission"]),
        "TURNSTILE_METRICS_PORT": "0",
        "TURNSTILE_REDIS_URL": redis_url,
        "TURNSTILE_SUBSTRATE_ADDR": f"127.0.0.1:{ports['substrate']}",
        "TURNSTILE_CLIENT_ALLOWLIST": '["acme"]',
        "TURNSTILE_LOG_LEVEL": "WARNING",
        "TURNSTILE_CAP__DEFAULT_CAP": "1000000",
        "TURNSTILE_RATE__DEFAULT_BURST": "1000000",
        "TURNSTILE_RATE__CLUSTER_BURST": "1000000",
        "TURNSTILE_CONCURRENCY__DEFAULT_LIMIT": "1000000",
        "TURNSTILE_SLOTS__DEFAULT_PER_NODE": "100000",
        "TURNSTILE_HOLD_TTL_S": "5",
        "TURNSTILE_PENDING_TTL_S": "5",
        "OTEL_TRACES_EXPORTER": "otlp",
        "OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{ports['otlp']}",
        "OTEL_EXPORTER_OTLP_INSECURE": "true",
        "OTEL_TRACES_SAMPLER": opts.sampler,
        "OTEL_TRACES_SAMPLER_ARG": opts.sampler_arg,
        "TURNSTILE_PLAINTEXT": "true",
    }


Make = Callable[[], admission_pb2.AdmitRequest]


def request_makers() -> dict[str, Make]:
    """The two Admit shapes, each call a new sandbox id: ``cold`` and ``resume``. The ids
    are in acme's namespace (``acme--…``), which a ``self``-scoped Admit needs (SPEC O1)."""
    sequence = iter(range(10**9))

    def cold() -> admission_pb2.AdmitRequest:
        return admission_pb2.AdmitRequest(
            sandbox_id=f"acme--sb-{next(sequence)}",
            client=common_pb2.ActivationClient(client_id="acme"),
            kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
            candidate_nodes=["node-a", "node-b", "node-c"],
        )

    def resume() -> admission_pb2.AdmitRequest:
        request = cold()
        request.kind = common_pb2.ACTIVATION_KIND_RESUME
        del request.candidate_nodes[:]
        return request

    return {"cold": cold, "resume": resume}


async def bench(opts: Options) -> None:
    redis_proc = RedisProcess().start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        table = opts.only != "alternating"
        names = ["evalsha", "substrate", "otlp", "admission"]
        if table:
            names += ["echo", "platform", "admission_full"]
        ports = {name: free_port() for name in names}
        pids: dict[str, int] = {}
        env = admission_env(ports, redis_proc.url, opts)
        admissions = {"admission": env}
        if table:
            admissions["admission_full"] = env | {
                "TURNSTILE_PORT": str(ports["admission_full"]),
                "OTEL_TRACES_SAMPLER": "parentbased_always_on",
                "OTEL_TRACES_SAMPLER_ARG": "",
            }
        for name in ("echo", "evalsha", "substrate", "otlp", "platform"):
            if name in ports:
                server_env = env if name == "platform" else None
                procs.append(spawn(name, ports[name], redis_proc.url, server_env))
                pids[name] = procs[-1].pid
        for name, process_env in admissions.items():
            command = [sys.executable, "-m", "turnstile_admission"]
            procs.append(subprocess.Popen(command, env=process_env))  # noqa: ASYNC220 - start-up only
            pids[name] = procs[-1].pid
        for name in admissions:
            _wait(ports[name])

        makers = request_makers()
        payload = makers["cold"]().SerializeToString()
        redis = aioredis.Redis.from_url(redis_proc.url)
        # The live counts are current, as a substrate leader keeps them (no pods).
        await redis.set(LiveCountKeys("turnstile:").state, COUNTED)
        summary: dict[str, Any] = {"schema": 1, "goals": {}}
        results: dict[str, dict[int, dict[str, float]]] = {}
        if table:
            results, summary = await single_pass(ports, pids, redis, makers, payload, opts.seconds)
        alternating: dict[str, Any] | None = None
        if opts.alt_rounds:
            alternating = await alternating_rounds(
                ports, pids, redis, makers, payload, opts.alt_rounds, opts.seconds / 2
            )
            summary["alternating"] = alternating
            summary["goals"] |= alternating_goals(alternating)
            summary["informational"] = mix_informational(alternating)
        await redis.aclose()
        if not table:
            summary["load_avg_1m"] = round(os.getloadavg()[0], 2)
        print_goals(summary, alternating)
        summary["sampler"] = {"name": opts.sampler, "arg": opts.sampler_arg}
        if table:
            if opts.rounds:
                report_security(
                    await bench_security(
                        env, redis_proc.url, makers["cold"], opts.seconds, opts.rounds
                    )
                )
            await in_process_costs(summary, results, opts)
        line = json.dumps(summary, sort_keys=True)
        print("\n" + line)
        if opts.json_path:
            with open(opts.json_path, "w") as out:  # noqa: ASYNC230 - after the measurements
                out.write(line + "\n")
    finally:
        # Admission first: it flushes its spans to the OTLP sink as it stops.
        for proc in reversed(procs):
            proc.terminate()
            proc.wait(timeout=15)
        redis_proc.close()


async def single_pass(
    ports: dict[str, int],
    pids: dict[str, int],
    redis: aioredis.Redis,
    makers: dict[str, Make],
    payload: bytes,
    seconds: float,
) -> tuple[dict[str, dict[int, dict[str, float]]], dict[str, Any]]:
    """The table: each ceiling, then each Admit run, one after another (the module
    docstring), and tracing's cost; returns the results and the JSON summary."""
    cold, resume = makers["cold"], makers["resume"]
    results: dict[str, dict[int, dict[str, float]]] = {}
    for name in ("echo", "evalsha", "platform"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[name]}") as channel:
            echo = channel.unary_unary(ECHO, request_serializer=BYTES, response_deserializer=BYTES)
            results[name] = {
                n: await measure(functools.partial(echo, payload), n, seconds, pids[name])
                for n in (1, 64)
            }
    decisions = 0
    before = await commandstats(redis)
    usec_before = await script_usec(redis)
    cpu_before = await redis_cpu_s(redis)
    runs = (
        ("admission", "admit_cold", cold),
        ("admission", "admit_resume", resume),
        ("admission_full", "admit_cold_sampled_100", cold),
    )
    for server, name, make in runs:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports[server]}") as channel:
            stub: Any = admission_pb2_grpc.AdmissionServiceStub(channel)
            results[name] = {}
            for n in (1, 64):
                answer = await stub.Admit(make())
                assert answer.decision == admission_pb2.DECISION_ADMITTED, answer.message
                results[name][n] = await measure(_admit(stub, make), n, seconds, pids[server])
                decisions += int(results[name][n]["calls"]) + 201
    # Tracing's cost: the two admission processes alternate, cold create at 64
    # in flight, so drift in the machine's load falls on both alike.
    tracing: list[float] = []
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{ports['admission']}") as production,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports['admission_full']}") as full,
    ):
        prod_stub: Any = admission_pb2_grpc.AdmissionServiceStub(production)
        full_stub: Any = admission_pb2_grpc.AdmissionServiceStub(full)
        for _ in range(3):
            sampled = await measure(_admit(prod_stub, cold), 64, seconds / 2)
            everything = await measure(_admit(full_stub, cold), 64, seconds / 2)
            tracing.append(everything["rps"] / sampled["rps"])
            decisions += int(sampled["calls"] + everything["calls"]) + 400
    after = await commandstats(redis)
    usec = await script_usec(redis) - usec_before
    redis_cpu = await redis_cpu_s(redis) - cpu_before
    count_calls = int(await redis.get(COUNT_CALLS) or 0)
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    summary = report(results, delta, decisions, count_calls)
    per_script = usec / max(1, delta.get("evalsha", 1))
    print(f"Redis time inside the script, per decision: {per_script:.1f} µs")
    summary["script_usec_per_decision"] = round(per_script, 1)
    cpu_per_decision = redis_cpu * 1e6 / max(1, decisions)
    print(
        "Redis main-thread CPU per decision (the script, its reply, the watcher's "
        f"polls; load-independent): {cpu_per_decision:.1f} µs"
    )
    summary["redis_cpu_us_per_decision"] = round(cpu_per_decision, 1)
    ratio = statistics.median(tracing)
    print(
        "tracing everything ÷ the production sampler, cold create at 64 in flight, "
        f"alternating: {', '.join(f'{r:.2f}' for r in tracing)} (median {ratio:.2f})"
    )
    summary["goals"]["cold_64_sampled_100_per_production_sampler_alternating"] = round(ratio, 3)
    return results, summary


async def in_process_costs(
    summary: dict[str, Any], results: dict[str, dict[int, dict[str, float]]], opts: Options
) -> None:
    """The authorization check and the platform interceptor alone, inside one process."""
    cost = await authorization_check_cost()
    sequential = results["admit_cold"][1]["p50_ms"] * 1000
    print_costs(
        "the authorization check alone, per call (inside a real mTLS handler):",
        {f"as {caller}": micros for caller, micros in cost.items()},
        sequential,
        f"a sequential Admit (p50 {sequential:.0f} µs)",
    )
    summary["authorization_check_us"] = {k: round(v, 2) for k, v in cost.items()}
    chain = await interceptor_cpu_cost(opts.sampler, opts.sampler_arg)
    ceiling = results["evalsha"][64]["cpu_us"]
    print_costs(
        "the platform interceptor alone, CPU per call (inside a real handler):",
        chain,
        ceiling,
        f"the EVALSHA ceiling's server CPU per call at 64 ({ceiling:.0f} µs)",
    )
    summary["interceptor_cpu_us"] = {k: round(v, 2) for k, v in chain.items()}


SHAPES = {"cold": "cold create", "resume": "resume"}
#: The production mix's shape in the alternating rounds: a resume Admit then the
#: CommitHold of its hold, one turn of two RPCs (each one EVALSHA) against two
#: calls of the ceiling. Informational: the performance goals are on Admit alone.
MIX = "resume_commit"
MIX_LABEL = "resume+commit"
RPCS_PER_TURN = 2
#: The alternating rounds' shapes, in the order of an even round (odd: reversed).
ROUND_SHAPES = (*SHAPES, MIX)
#: One shape's round: per side (``evalsha``, ``admit``) and in-flight level, a ``measure``.
Phases = dict[str, dict[int, dict[str, float]]]


def _spread(values: list[float], digits: int = 3) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


class ResumeCommit:
    """One turn of the production mix: a resume ``Admit``, then ``CommitHold`` of
    the hold it got, as the substrate does once the runtime is back.

    The commit releases the hold's concurrency lease and deletes its record
    (``commit_hold.lua``), so however long the run, the key holds at most the
    turns in flight: the mix never meets the concurrency limit, and a hold is
    committed milliseconds into its ``TURNSTILE_HOLD_TTL_S``. What stays is each
    hold id's tombstone (the hold TTL plus a minute): memory, no limit counts it.
    A turn whose Admit is not ADMITTED (no hold to commit) or whose commit finds
    no hold is counted, not raised, so a run shows how many there were; any
    makes its figures suspect."""

    def __init__(self, stub: Any, make: Make) -> None:
        self._stub = stub
        self._make = make
        self.rpcs = 0
        self.not_admitted = 0
        self.not_committed = 0

    async def __call__(self) -> None:
        answer = await self._stub.Admit(self._make())
        self.rpcs += 1
        if answer.decision != admission_pb2.DECISION_ADMITTED:
            self.not_admitted += 1
            return
        commit = admission_pb2.CommitHoldRequest(hold_id=answer.hold_id)
        done = await self._stub.CommitHold(commit)
        self.rpcs += 1
        if not done.committed:
            self.not_committed += 1


def _twice(call: Callable[[], Awaitable[Any]]) -> Callable[[], Awaitable[None]]:
    """The ceiling's turn for the mix: two calls one after the other, as a turn's
    Admit and CommitHold are."""

    async def turn() -> None:
        await call()
        await call()

    return turn


async def alternating_rounds(
    ports: dict[str, int],
    pids: dict[str, int],
    redis: aioredis.Redis,
    makers: dict[str, Make],
    payload: bytes,
    rounds: int,
    seconds: float,
) -> dict[str, Any]:
    """Each shape right after its own EVALSHA ceiling phase, in ``rounds`` rounds
    whose order of shapes alternates (cold, resume, resume + commit; then the
    reverse).

    Per round and shape: the ceiling then the shape at 64 in flight, the ceiling
    then the shape at 1, ``seconds`` each. Every ratio compares two phases taken
    seconds apart, against the same Redis (the single pass compares an Admit run
    with a ceiling measured a minute before it, against a Redis the Admit runs in
    between filled with holds), so the machine's drift falls on both sides; the
    median over rounds shrugs off one disturbed phase. Besides the ratios, Redis's
    main-thread CPU per call in each phase at 64 (``INFO cpu``): the ceiling's one
    ``INCR`` against ``admit.lua``. The mix (:class:`ResumeCommit`) runs turns of
    two RPCs against the ceiling's turns of two calls, so its ratios are per RPC;
    its phases also count the scripts Redis ran per RPC (``INFO commandstats``)."""
    load_before = os.getloadavg()[0]
    per_round: dict[str, list[Phases]] = {shape: [] for shape in ROUND_SHAPES}
    async with (
        grpc.aio.insecure_channel(f"127.0.0.1:{ports['evalsha']}") as ceiling_channel,
        grpc.aio.insecure_channel(f"127.0.0.1:{ports['admission']}") as admission_channel,
    ):
        echo = ceiling_channel.unary_unary(
            ECHO, request_serializer=BYTES, response_deserializer=BYTES
        )
        ceiling = functools.partial(echo, payload)
        stub: Any = admission_pb2_grpc.AdmissionServiceStub(admission_channel)
        mix = ResumeCommit(stub, makers["resume"])
        calls: dict[str, Callable[[], Awaitable[Any]]] = {
            shape: _admit(stub, makers[shape]) for shape in SHAPES
        } | {MIX: mix}
        ceilings = dict.fromkeys(SHAPES, ceiling) | {MIX: _twice(ceiling)}
        for make in makers.values():
            answer = await stub.Admit(make())
            assert answer.decision == admission_pb2.DECISION_ADMITTED, answer.message
            for _ in range(100):  # first calls (script loads, pools, caches): no phase's
                await ceiling()
                await stub.Admit(make())
        for _ in range(50):  # CommitHold's first calls too
            await mix()
        scripts, rpcs = 0, 0
        for r in range(rounds):
            for shape in ROUND_SHAPES if r % 2 == 0 else reversed(ROUND_SHAPES):
                phases: Phases = {"evalsha": {}, "admit": {}}
                for n in (64, 1):
                    # The channels and both servers are warm by now: a short warm-up.
                    phases["evalsha"][n] = await measure(
                        ceilings[shape], n, seconds, pids["evalsha"], redis, warm_up=50
                    )
                    counted = shape == MIX
                    before = await commandstats(redis) if counted else {}
                    rpcs_before = mix.rpcs
                    phases["admit"][n] = await measure(
                        calls[shape], n, seconds, pids["admission"], redis, warm_up=50
                    )
                    if counted:  # warm-up included: every RPC made between the two reads
                        scripts += _scripts(before, await commandstats(redis))
                        rpcs += mix.rpcs - rpcs_before
                per_round[shape].append(phases)
    load_after = os.getloadavg()[0]
    out: dict[str, Any] = {
        "rounds": rounds,
        "seconds_per_phase": seconds,
        "load_avg_1m": [round(load_before, 2), round(load_after, 2)],
    }
    out |= {shape: summarise_rounds(per_round[shape]) for shape in SHAPES}
    out[MIX] = summarise_mix(per_round[MIX]) | {
        "evalsha_per_rpc": round(scripts / max(1, rpcs), 4),
        "rpcs": rpcs,
        "not_admitted": mix.not_admitted,
        "not_committed": mix.not_committed,
    }
    print_alternating(out)
    return out


def _scripts(before: dict[str, int], after: dict[str, int]) -> int:
    """Scripts Redis ran between two ``INFO commandstats``: EVALSHA, EVAL and
    SCRIPT LOAD (a reload after ``NOSCRIPT``), as the single pass counts them."""
    return sum(after.get(k, 0) - before.get(k, 0) for k in ("evalsha", "eval", "script|load"))


def _ratio(runs: list[Phases], n: int, field: str) -> dict[str, float]:
    """The shape's phase ÷ the ceiling phase before it, over the rounds."""
    return _spread([p["admit"][n][field] / p["evalsha"][n][field] for p in runs])


def _sides(
    runs: list[Phases], n: int, field: str, digits: int, scale: float = 1.0
) -> dict[str, dict[str, float]]:
    """Each side's own figure over the rounds, times ``scale``."""
    return {
        side: _spread([p[side][n][field] * scale for p in runs], digits)
        for side in ("evalsha", "admit")
    }


def summarise_rounds(runs: list[Phases]) -> dict[str, Any]:
    """One shape's rounds as median, min and max: the ratios of the Admit phase to
    the ceiling phase before it, and each side's own figures (JSON keys in the
    module docstring)."""
    return {
        "rps_64_per_evalsha": _ratio(runs, 64, "rps"),
        "p50_1_per_evalsha_p50": _ratio(runs, 1, "p50_ms"),
        "server_cpu_64_per_evalsha": _ratio(runs, 64, "cpu_us"),
        "server_cpu_us_per_call_64": _sides(runs, 64, "cpu_us", 1),
        "redis_cpu_us_per_call_64": _sides(runs, 64, "redis_cpu_us", 1),
        "rps_64": _sides(runs, 64, "rps", 0),
        "p50_ms_1": _sides(runs, 1, "p50_ms", 3),
    }


def summarise_mix(runs: list[Phases]) -> dict[str, Any]:
    """The mix's rounds, per RPC: a phase measured turns (two RPCs on either side),
    so its ratios are per RPC as they stand and its own figures are converted;
    the p50 stays one turn's (JSON keys in the module docstring)."""
    per_rpc = 1 / RPCS_PER_TURN
    return {
        "rps_64_per_evalsha": _ratio(runs, 64, "rps"),
        "p50_1_per_evalsha_p50": _ratio(runs, 1, "p50_ms"),
        "server_cpu_64_per_evalsha": _ratio(runs, 64, "cpu_us"),
        "server_cpu_us_per_rpc_64": _sides(runs, 64, "cpu_us", 1, per_rpc),
        "redis_cpu_us_per_rpc_64": _sides(runs, 64, "redis_cpu_us", 1, per_rpc),
        "rpcs_per_s_64": _sides(runs, 64, "rps", 0, RPCS_PER_TURN),
        "turn_p50_ms_1": _sides(runs, 1, "p50_ms", 3),
    }


def print_alternating(out: dict[str, Any]) -> None:
    """The alternating rounds' table: one line per shape, median (range) of each ratio."""

    def spread(figure: dict[str, float], digits: int = 2) -> str:
        low, high = f"{figure['min']:.{digits}f}", f"{figure['max']:.{digits}f}"
        return f"{figure['median']:.{digits}f} ({low}-{high})"

    before, after = out["load_avg_1m"]
    print(
        f"\nAdmit ÷ the EVALSHA ceiling phase just before it: {out['rounds']} rounds, order "
        f"of shapes alternating, {out['seconds_per_phase']:g} s per phase, load average "
        f"{before:.2f} → {after:.2f}; median (range) over the rounds"
    )
    print(
        f"  {'÷ the ceiling':<14}{'calls/s @64':>18}{'p50 @1':>18}{'server CPU @64':>18}"
        "     Redis CPU µs/call @64: ceiling | Admit"
    )
    labels = SHAPES | {MIX: MIX_LABEL}
    for shape, label in labels.items():
        figures = out[shape]
        redis_cpu = figures[
            "redis_cpu_us_per_rpc_64" if shape == MIX else "redis_cpu_us_per_call_64"
        ]
        print(
            f"  {label:<14}{spread(figures['rps_64_per_evalsha']):>18}"
            f"{spread(figures['p50_1_per_evalsha_p50']):>18}"
            f"{spread(figures['server_cpu_64_per_evalsha']):>18}"
            f"{spread(redis_cpu['evalsha'], 1):>39} | {spread(redis_cpu['admit'], 1)}"
        )
    mix = out[MIX]
    failures = mix["not_admitted"] + mix["not_committed"]
    print(
        f"  {MIX_LABEL}: a resume Admit then its CommitHold against two ceiling calls, "
        "so per RPC (p50: one turn); informational, not an issue goal"
    )
    print(
        f"  {MIX_LABEL}: EVALSHA per RPC {mix['evalsha_per_rpc']:.3f} over {mix['rpcs']} RPCs; "
        f"not admitted {mix['not_admitted']}, not committed {mix['not_committed']}"
        + ("  <- FAILURES: the mix's figures are not a clean run's" if failures else "")
    )


def alternating_goals(alternating: dict[str, Any]) -> dict[str, float]:
    """The goals' ratios from the alternating rounds (medians), keyed as the single
    pass's with ``_alternating`` appended."""
    return {
        "cold_64_per_evalsha_alternating": alternating["cold"]["rps_64_per_evalsha"]["median"],
        "cold_1_p50_per_evalsha_p50_alternating": alternating["cold"]["p50_1_per_evalsha_p50"][
            "median"
        ],
        "resume_64_per_evalsha_alternating": alternating["resume"]["rps_64_per_evalsha"]["median"],
    }


def mix_informational(alternating: dict[str, Any]) -> dict[str, float]:
    """The mix's medians, keyed like the goals (per RPC; the p50 one turn's against
    two ceiling calls): figures to read beside the goals, not performance goals."""
    mix = alternating[MIX]
    return {
        "resume_commit_64_per_evalsha_alternating": mix["rps_64_per_evalsha"]["median"],
        "resume_commit_1_p50_per_evalsha_p50_alternating": mix["p50_1_per_evalsha_p50"]["median"],
        "cpu_resume_commit_64_per_evalsha_alternating": mix["server_cpu_64_per_evalsha"]["median"],
        "resume_commit_evalsha_per_rpc": mix["evalsha_per_rpc"],
    }


def print_goals(summary: dict[str, Any], alternating: dict[str, Any] | None) -> None:
    """The goals line, each ratio as "single pass | alternating median" where both
    were measured (the alternating median is the one to judge by: module docstring);
    then server CPU per call against the ceiling's, likewise."""
    goals = summary["goals"]
    cpu = summary.get("cpu_per_call", {})
    if alternating:
        for shape in SHAPES:
            figure = alternating[shape]["server_cpu_64_per_evalsha"]["median"]
            cpu = cpu | {f"cpu_{shape}_64_per_evalsha_alternating": figure}

    def both(figures: dict[str, Any], key: str) -> str:
        return " | ".join(str(figures[k]) for k in (key, f"{key}_alternating") if k in figures)

    order = (
        "[single pass | alternating median, judge by the latter] "
        if alternating and "runs" in summary
        else ""
    )
    line = (
        f"goals: {order}cold@64 {both(goals, 'cold_64_per_evalsha')}x evalsha (>= 0.6), "
        f"cold p50 {both(goals, 'cold_1_p50_per_evalsha_p50')}x (<= 1.5), "
        f"resume@64 {both(goals, 'resume_64_per_evalsha')}x (>= 0.75)"
    )
    if "platform_64_per_evalsha" in goals:
        line += (
            "; 100 % sampling / production sampler at 64: "
            "{cold_64_sampled_100_per_production_sampler}; the platform's interceptors alone: "
            "{platform_64_per_evalsha}x at 64, p50 {platform_1_p50_per_evalsha_p50}x".format(
                **goals
            )
        )
    print(f"\n{line}")
    platform = (
        f"platform {cpu['cpu_platform_64_per_evalsha']}, "
        if "cpu_platform_64_per_evalsha" in cpu
        else ""
    )
    print(
        f"server CPU per call ÷ the EVALSHA ceiling's at 64: {platform}"
        f"cold {both(cpu, 'cpu_cold_64_per_evalsha')}, "
        f"resume {both(cpu, 'cpu_resume_64_per_evalsha')}"
    )
    if informational := summary.get("informational"):
        print(
            "informational, not an issue goal (the production mix, per RPC, alternating "
            f"median): {MIX_LABEL}@64 "
            f"{informational['resume_commit_64_per_evalsha_alternating']}x evalsha, "
            "p50 of a turn "
            f"{informational['resume_commit_1_p50_per_evalsha_p50_alternating']}x two "
            "ceiling calls, server CPU "
            f"{informational['cpu_resume_commit_64_per_evalsha_alternating']}x, "
            f"EVALSHA per RPC {informational['resume_commit_evalsha_per_rpc']}"
        )


async def bench_security(
    plain_env: dict[str, str],
    redis_url: str,
    cold: Callable[[], admission_pb2.AdmitRequest],
    seconds: float,
    rounds: int,
) -> dict[str, dict[int, list[dict[str, float]]]]:
    """COLD_CREATE on four admission processes (plaintext, mTLS, mTLS + authorization
    as a service and as a ``self``-scoped client), measured in interleaved rounds so
    each ratio compares figures taken seconds apart (module docstring)."""
    results: dict[str, dict[int, list[dict[str, float]]]] = {
        mode: {1: [], 64: []} for mode in ("plaintext", *SECURE_MODES)
    }
    procs: list[subprocess.Popen[bytes]] = []
    channels: dict[str, grpc.aio.Channel] = {}
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        ensure_local_pki(directory, "turnstile.local", HOLDERS, servers={"admission"})
        policy = directory / "policy.toml"
        policy.write_text(POLICY.read_text() + SELF_RULE)
        try:
            plain_substrate, tls_substrate = free_port(), free_port()
            procs.append(spawn("substrate", plain_substrate, redis_url))
            procs.append(
                spawn("substrate", tls_substrate, redis_url, {"BENCH_TLS_DIR": str(directory)})
            )
            for mode in results:
                port = free_port()
                files = _files(directory, "admission")
                env = {
                    **plain_env,
                    "TURNSTILE_PORT": str(port),
                    "TURNSTILE_SUBSTRATE_ADDR": f"127.0.0.1:{plain_substrate}",
                }
                if mode != "plaintext":
                    env |= {
                        "TURNSTILE_PLAINTEXT": "false",
                        "TURNSTILE_SUBSTRATE_ADDR": f"127.0.0.1:{tls_substrate}",
                        "TURNSTILE_TLS_CERT_FILE": str(files.cert_file),
                        "TURNSTILE_TLS_KEY_FILE": str(files.key_file),
                        "TURNSTILE_TLS_CA_FILE": str(files.ca_file),
                        "TURNSTILE_AUTHZ_POLICY_FILE": str(policy),
                    }
                procs.append(spawn(f"admission-{mode}", port, redis_url, env))
                caller = "acme" if mode == "mtls+self" else "substrate"
                address = f"127.0.0.1:{port}"
                channels[mode] = (
                    grpc.aio.insecure_channel(address)
                    if mode == "plaintext"
                    else grpc.aio.secure_channel(
                        address, tls.channel_credentials(_files(directory, caller))
                    )
                )
            stubs: dict[str, Any] = {
                mode: admission_pb2_grpc.AdmissionServiceStub(channel)
                for mode, channel in channels.items()
            }
            for stub in stubs.values():
                answer = await stub.Admit(cold())
                assert answer.decision == admission_pb2.DECISION_ADMITTED, answer
            for _ in range(rounds):
                for n in (1, 64):
                    for mode, stub in stubs.items():
                        results[mode][n].append(await measure(_admit(stub, cold), n, seconds))
        finally:
            for channel in channels.values():
                await channel.close(None)
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait(timeout=15)
    return results


async def authorization_check_cost(repeat: int = 5000) -> dict[str, float]:
    """Microseconds per call of the authorization check alone, measured inside a real
    mTLS handler (so ``peer_identities`` reads a real connection): the method check
    as the substrate identity, and method + client check as ``client/acme``."""
    from turnstile_platform.authz.authorizer import Authorizer
    from turnstile_platform.authz.watcher import PolicyWatcher

    out: dict[str, float] = {}
    method = "/turnstile.admission.v1.AdmissionService/Admit"
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        ensure_local_pki(directory, "turnstile.local", HOLDERS, servers={"admission"})
        policy = directory / "policy.toml"
        policy.write_text(POLICY.read_text() + SELF_RULE)
        checker = Authorizer(PolicyWatcher(policy, poll_interval_s=60))
        request = admission_pb2.AdmitRequest(
            sandbox_id="acme--sb", client=common_pb2.ActivationClient(client_id="acme")
        )

        async def timed(payload: bytes, context: Any) -> bytes:
            started = time.perf_counter()
            for _ in range(repeat):
                await checker.authorize(context, method, False, request)
            out[payload.decode()] = (time.perf_counter() - started) / repeat * 1e6
            return payload

        server = grpc.aio.server()
        server.add_generic_rpc_handlers(
            (
                grpc.method_handlers_generic_handler(
                    "bench.Echo",
                    {"Echo": grpc.unary_unary_rpc_method_handler(timed, BYTES, BYTES)},
                ),
            )
        )
        port = server.add_secure_port(
            "127.0.0.1:0", tls.server_credentials(_files(directory, "admission"))
        )
        await server.start()
        try:
            for caller in ("substrate", "acme"):
                credentials = tls.channel_credentials(_files(directory, caller))
                async with grpc.aio.secure_channel(f"127.0.0.1:{port}", credentials) as channel:
                    echo = channel.unary_unary(
                        ECHO, request_serializer=BYTES, response_deserializer=BYTES
                    )
                    await echo(caller.encode())
        finally:
            await server.stop(None)
    return out


async def interceptor_cpu_cost(
    sampler: str, sampler_arg: str, repeat: int = 5000
) -> dict[str, float]:
    """CPU µs per call of the platform interceptor (``intercept_service`` and the
    wrapped handler, as grpc.aio runs them per call) around a handler that returns
    at once, run ``repeat`` times inside a real handler on its real servicer
    context; beside the same handler called bare. Once with ``sampler`` and once
    tracing everything (spans kept in process, not exported)."""
    import types

    from turnstile_platform.call_limits import CallLimits
    from turnstile_platform.interceptors import PlatformInterceptor
    from turnstile_platform.tracing import ServerSpans, create_tracer_provider

    async def inner(request: bytes, context: Any) -> bytes:
        return request

    handler = grpc.unary_unary_rpc_method_handler(inner, BYTES, BYTES)

    async def resolve(details: Any) -> Any:
        return handler

    details: Any = types.SimpleNamespace(method=ECHO, invocation_metadata=())
    interceptors = {}
    saved = {k: os.environ.get(k) for k in ("OTEL_TRACES_SAMPLER", "OTEL_TRACES_SAMPLER_ARG")}
    for label, name, arg in (
        (f"{sampler} {sampler_arg}", sampler, sampler_arg),
        ("parentbased_always_on", "parentbased_always_on", ""),
    ):
        # The SDK builds a sampler from these variables (as the service's do).
        os.environ["OTEL_TRACES_SAMPLER"], os.environ["OTEL_TRACES_SAMPLER_ARG"] = name, arg
        provider = create_tracer_provider("bench-interceptor")
        limits = CallLimits(unary=1_000_000, streams=1_000_000)
        interceptors[label] = PlatformInterceptor(spans=ServerSpans(provider), limits=limits)
    for key, value in saved.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    out: dict[str, float] = {}

    async def timed(payload: bytes, context: Any) -> bytes:
        started = time.process_time()
        for _ in range(repeat):
            await (await resolve(details)).unary_unary(payload, context)
        out["bare handler"] = (time.process_time() - started) / repeat * 1e6
        for label, interceptor in interceptors.items():
            started = time.process_time()
            for _ in range(repeat):
                wrapped: Any = await interceptor.intercept_service(resolve, details)
                await wrapped.unary_unary(payload, context)
            out[f"interceptor, {label}"] = (time.process_time() - started) / repeat * 1e6
        return payload

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        (
            grpc.method_handlers_generic_handler(
                "bench.Echo", {"Echo": grpc.unary_unary_rpc_method_handler(timed, BYTES, BYTES)}
            ),
        )
    )
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            echo = channel.unary_unary(ECHO, request_serializer=BYTES, response_deserializer=BYTES)
            await echo(b"x" * 40)
    finally:
        await server.stop(None)
    return out


def print_costs(title: str, costs: dict[str, float], against: float, of_what: str) -> None:
    """One line per cost in µs, with its share of ``against`` (µs, described by ``of_what``)."""
    print(f"\n{title}")
    for label, micros in costs.items():
        print(f"  {label:<44} {micros:6.1f} µs = {micros / against:.2%} of {of_what}")


def report_security(results: dict[str, dict[int, list[dict[str, float]]]]) -> None:
    """Per mode: median calls/s and p50 over the rounds, and the median of the
    per-round ratios (mtls ÷ plaintext; the authorization modes ÷ mtls)."""
    print("\nAdmit COLD_CREATE under transport security (medians over rounds):")
    print(
        f"{'mode':<12}{'in flight':>10}{'calls/s':>10}{'p50 ms':>9}{'ratio (per-round range)':>40}"
    )
    for n in (1, 64):
        for mode, by_n in results.items():
            runs = by_n[n]
            rps = statistics.median(r["rps"] for r in runs)
            p50 = statistics.median(r["p50_ms"] for r in runs)
            ratio = ""
            if mode != "plaintext":
                against = "plaintext" if mode == "mtls" else "mtls"
                ratios = [
                    r["rps"] / b["rps"] for r, b in zip(runs, results[against][n], strict=True)
                ]
                ratio = (
                    f"{statistics.median(ratios):.3f} of {against} "
                    f"({min(ratios):.2f}-{max(ratios):.2f})"
                )
            print(f"{mode:<12}{n:>10}{rps:>10.0f}{p50:>9.2f}{ratio:>40}")


def report(
    results: dict[str, dict[int, dict[str, float]]],
    delta: dict[str, int],
    decisions: int,
    count_calls: int,
) -> dict[str, Any]:
    """Print the table and return the same figures as a JSON-ready dict (stable keys)."""
    print(
        f"{'server':<24}{'in flight':>10}{'calls/s':>10}{'p50 ms':>9}{'p99 ms':>9}"
        f"{'/echo':>8}{'/evalsha':>10}{'CPU µs/call':>13}{'/evalsha':>10}"
    )
    runs: dict[str, Any] = {}
    for name, by_n in results.items():
        runs[name] = {}
        for n, r in by_n.items():
            echo = r["rps"] / results["echo"][n]["rps"]
            evalsha = r["rps"] / results["evalsha"][n]["rps"]
            cpu = r["cpu_us"] / results["evalsha"][n]["cpu_us"]
            print(
                f"{name:<24}{n:>10}{r['rps']:>10.0f}{r['p50_ms']:>9.2f}{r['p99_ms']:>9.2f}"
                f"{echo:>8.2f}{evalsha:>10.2f}{r['cpu_us']:>13.0f}{cpu:>10.2f}"
            )
            runs[name][str(n)] = {
                "calls": int(r["calls"]),
                "rps": round(r["rps"], 1),
                "p50_ms": round(r["p50_ms"], 3),
                "p99_ms": round(r["p99_ms"], 3),
                "rps_per_echo": round(echo, 3),
                "rps_per_evalsha": round(evalsha, 3),
                "server_cpu_us_per_call": round(r["cpu_us"], 1),
                "server_cpu_per_evalsha": round(cpu, 3),
            }
    top_level = delta.get("evalsha", 0) + delta.get("eval", 0) + delta.get("script|load", 0)
    total = sum(v for k, v in delta.items() if k not in ("info",))
    ceiling_p50 = results["evalsha"][1]["p50_ms"]
    goals = {
        "cold_64_per_evalsha": round(
            results["admit_cold"][64]["rps"] / results["evalsha"][64]["rps"], 3
        ),
        "cold_1_p50_per_evalsha_p50": round(results["admit_cold"][1]["p50_ms"] / ceiling_p50, 3),
        "resume_64_per_evalsha": round(
            results["admit_resume"][64]["rps"] / results["evalsha"][64]["rps"], 3
        ),
        "platform_64_per_evalsha": round(
            results["platform"][64]["rps"] / results["evalsha"][64]["rps"], 3
        ),
        "platform_1_p50_per_evalsha_p50": round(results["platform"][1]["p50_ms"] / ceiling_p50, 3),
        "cold_64_per_platform": round(
            results["admit_cold"][64]["rps"] / results["platform"][64]["rps"], 3
        ),
        "cold_64_sampled_100_per_production_sampler": round(
            results["admit_cold_sampled_100"][64]["rps"] / results["admit_cold"][64]["rps"], 3
        ),
    }
    # Server CPU per call against the one-EVALSHA ceiling's, at 64 in flight: the
    # inverse of the throughput ratio a CPU-bound replica reaches.
    cpu_64 = results["evalsha"][64]["cpu_us"]
    cpu_goals = {
        f"cpu_{name}_64_per_evalsha": round(results[run][64]["cpu_us"] / cpu_64, 3)
        for name, run in (
            ("platform", "platform"),
            ("cold", "admit_cold"),
            ("resume", "admit_resume"),
        )
    }
    print(f"\ndecisions: {decisions}")
    print(f"scripts (EVALSHA/EVAL) per decision: {top_level / decisions:.3f}")
    print(
        f"all commands per decision (incl. those inside the script and the key-set "
        f"watcher's polls): {total / decisions:.2f}"
    )
    print(f"CountLiveSandboxes calls per decision: {count_calls / decisions:.3f}")
    print("commandstats delta:", {k: v for k, v in sorted(delta.items()) if v})
    return {
        "schema": 1,
        "load_avg_1m": round(os.getloadavg()[0], 2),
        "runs": runs,
        "goals": goals,
        "cpu_per_call": cpu_goals,
        "decisions": decisions,
        "scripts_per_decision": round(top_level / decisions, 4),
        "commands_per_decision": round(total / decisions, 3),
        "count_live_calls_per_decision": round(count_calls / decisions, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument(
        "--seconds", type=float, default=3.0, help="per measurement (alternating: half of it)"
    )
    parser.add_argument(
        "--rounds", type=int, default=3, help="interleaved rounds of the security modes (0: skip)"
    )
    parser.add_argument(
        "--alt-rounds",
        type=int,
        default=3,
        help="alternating rounds of each Admit shape beside its own ceiling (0: skip)",
    )
    parser.add_argument(
        "--only",
        choices=["alternating"],
        help="run only that part (alternating: the rounds alone, for quick A/B checks)",
    )
    parser.add_argument("--serve", nargs=3, metavar=("KIND", "PORT", "REDIS_URL"))
    parser.add_argument(
        "--sampler",
        default=PRODUCTION_SAMPLER,
        help="OTEL_TRACES_SAMPLER of the admission under test (default: the production overlay's)",
    )
    parser.add_argument("--sampler-arg", default=PRODUCTION_SAMPLER_ARG)
    parser.add_argument("--json", metavar="PATH", help="also write the JSON summary to PATH")
    args = parser.parse_args()
    if args.serve:
        kind, port, url = args.serve
        if kind.startswith("admission-"):
            serve_admission(unchecked=kind == "admission-mtls")
            return
        uvloop.run(SERVERS[kind](int(port), url))
    else:
        if args.only == "alternating" and not args.alt_rounds:
            parser.error("--only alternating needs --alt-rounds of at least 1")
        options = Options(
            seconds=args.seconds,
            rounds=args.rounds,
            alt_rounds=args.alt_rounds,
            only=args.only,
            sampler=args.sampler,
            sampler_arg=args.sampler_arg,
            json_path=args.json,
        )
        uvloop.run(bench(options))


if __name__ == "__main__":
    main()
