"""What the decision log (SPEC Q3) costs ``Admit``: the log on ÷ off in the same run.

    uv run python services/admission/bench/bench_decision_log.py [--seconds 2] [--rounds 5]

Two admission processes side by side, as ``turnstile-admission`` runs them (uvloop,
tracing to an OTLP sink with the production sampler, a stub substrate), on one
private redis-server of the run's own, under two prefixes: one with the decision
log on (the default bounds), one with it off (``TURNSTILE_DECISION_LOG__MAX_ENTRIES=0``).
Limits are high, so every call takes the full path and is admitted.

In each round, for each shape — ``cold`` (COLD_CREATE with every policy, three
candidate nodes) and ``resume`` (RESUME: concurrency only, the cheapest decision,
where the log's share is largest) — the log-on and the log-off service are
measured one after the other at 64 calls in flight for ``--seconds``; which side
goes first, and the order of the shapes, alternate from round to round, so the
machine's drift falls on both. Per shape, the median over the rounds (and range) of:

* ``rps_on_per_off``          calls/s with the log ÷ without (goal ≥ 0.95);
* ``server_cpu_on_per_off``   admission's CPU time per call with ÷ without;
* ``redis_cpu_us_per_decision_on`` / ``_off``: Redis main-thread CPU per call
  (at these call rates mostly Redis's own background work, spread over the calls);
* ``script_us_on`` / ``_off``: Redis's time inside the decision script per call
  (``INFO commandstats``), and their difference, ``script_us_per_logged_decision``:
  what appending and trimming the log costs Redis per decision;

* ``cpu_on_per_off``: admission's CPU plus Redis's main-thread CPU per call, with
  ÷ without: what a decision costs the machine. On a shared machine the calls/s
  of a phase swing by a third on their own; the CPU per call hardly moves, and
  where the service and Redis share the cores it is what bounds the calls/s;

then ``script_cpu``: Redis's main-thread CPU per decision with the log on and
off, the decision script called one at a time from this process (CPU time, not
wall time: the steadiest figure on a loaded machine), and their difference;
``script_loop``: the same script run ``LOOP_CALLS`` times inside one EVAL (no
network, no argument parsing: the script's own CPU; the least of nine rounds); and,
from the log-on prefix's stream after the rounds, the Redis memory per logged
decision (``MEMORY USAGE`` ÷ ``XLEN``); and ``reads``: Redis's and this process's
CPU per ListDecisions read (:func:`read_cost`: a tenant's page, its sandbox filter
matching nothing, its window holding only another tenant's entries, an
operator's page). The run ends with one line of JSON.
Builds on ``bench_admit.py``'s servers and measurement (same directory).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import grpc.aio
import redis.asyncio as aioredis
import uvloop

sys.path.insert(0, str(Path(__file__).resolve().parent))

import bench_admit as base

from turnstile_clientkeys import LiveCountKeys
from turnstile_clientkeys.live_counts import COUNTED
from turnstile_contracts import admission_pb2_grpc
from turnstile_testing.processes import RedisProcess, free_port

SIDES = ("on", "off")
PREFIXES = {"on": "logon:", "off": "logoff:"}


def _env(port: int, side: str, ports: dict[str, int], redis_url: str) -> dict[str, str]:
    opts = base.Options(3.0, 0, 0, None, base.PRODUCTION_SAMPLER, base.PRODUCTION_SAMPLER_ARG, None)
    env = base.admission_env({**ports, "admission": port}, redis_url, opts)
    env["TURNSTILE_REDIS_PREFIX"] = PREFIXES[side]
    if side == "off":
        env["TURNSTILE_DECISION_LOG__MAX_ENTRIES"] = "0"
    return env


async def _evalsha(client: aioredis.Redis) -> tuple[int, int]:
    """EVALSHA calls and the microseconds Redis spent in them so far (commandstats)."""
    stats = (await client.info("commandstats")).get("cmdstat_evalsha", {})
    return int(stats.get("calls", 0)), int(stats.get("usec", 0))


#: Decisions per side and round of :func:`script_cpu`.
SCRIPT_CALLS = 3000


#: Limits high enough that every decision of :func:`script_cpu` and
#: :func:`script_loop` takes the full path and admits.
_LIMITS = {
    "cap": {"default_cap": 1_000_000},
    "rate": {"default_burst": 1_000_000, "cluster_burst": 1_000_000},
    "concurrency": {"default_limit": 1_000_000},
    "hold_ttl_s": 5,
    "pending_ttl_s": 5,
}


def _log_context() -> Any:
    """A production-like log context: a trace id, the substrate's identity."""
    from turnstile_admission.redis_store import LogContext

    return LogContext(
        "4bf92f3577b34da6a3ce929d0e0e4736",
        False,
        "spiffe://turnstile.local/service/substrate",
        "acme",
        "own",
        "1",
        "cold_create",
    )


def _settings(prefix: str, side: str) -> Any:
    """Admission's settings on ``prefix`` with the log on or off, the limits of
    :data:`_LIMITS`."""
    from turnstile_admission.settings import AdmissionSettings
    from turnstile_platform.settings import DecisionLogSettings

    return AdmissionSettings(
        redis_prefix=prefix,
        decision_log=DecisionLogSettings(max_entries=0 if side == "off" else 100_000),
        **_LIMITS,  # type: ignore[arg-type]
    )


def _store(client: aioredis.Redis, prefix: str, side: str) -> Any:
    """An AdmissionStore on ``prefix`` with :func:`_settings`."""
    from turnstile_admission.redis_store import AdmissionStore

    return AdmissionStore(client, _settings(prefix, side))


def _shapes() -> dict[str, tuple[Any, list[tuple[str, int]]]]:
    """Each shape's script modes and candidate nodes: cold create with every
    policy on three nodes, resume with concurrency only."""
    from turnstile_admission.policies import PolicyName

    resume = {PolicyName.CAP: 0, PolicyName.RATE: 0, PolicyName.CONCURRENCY: 2, PolicyName.SLOTS: 0}
    return {
        "cold": (
            dict.fromkeys(PolicyName, 2),
            [("node-a", 100_000), ("node-b", 100_000), ("node-c", 100_000)],
        ),
        "resume": (resume, []),
    }


def _on_off(
    per: dict[str, dict[str, list[float]]], pick: Any = statistics.median
) -> dict[str, dict[str, float]]:
    """Per shape, Redis CPU per decision on each side over the rounds (``pick``:
    median, or min) and their difference."""
    out: dict[str, dict[str, float]] = {}
    for shape, sides in per.items():
        on, off = pick(sides["on"]), pick(sides["off"])
        out[shape] = {
            "on_us": round(on, 1),
            "off_us": round(off, 1),
            "per_logged_decision_us": round(on - off, 1),
        }
    return out


async def script_cpu(client: aioredis.Redis, rounds: int = 3) -> dict[str, dict[str, float]]:
    """Redis's main-thread CPU per decision, log on and off, the script called one
    at a time from this process (no gRPC, no admission process): CPU time, not
    wall time, so the machine's load hardly moves it; the difference is what
    appending and trimming costs Redis per logged decision."""
    from turnstile_admission.redis_store import AdmitArgs

    stores = {}
    for side in SIDES:
        prefix = f"cpu{side}:"
        await client.set(LiveCountKeys(prefix).state, COUNTED)
        stores[side] = _store(client, prefix, side)
    shapes = _shapes()
    context = _log_context()
    per: dict[str, dict[str, list[float]]] = {s: {"on": [], "off": []} for s in shapes}
    n = 0
    for r in range(rounds):
        for shape, (modes, nodes) in shapes.items():
            for side in SIDES if r % 2 == 0 else tuple(reversed(SIDES)):
                store = stores[side]
                before = await base.redis_cpu_s(client)
                for _ in range(SCRIPT_CALLS):
                    n += 1
                    await store.admit(
                        AdmitArgs(f"{n:032x}", "acme", f"acme--sb-{n}", modes, nodes, log=context)
                    )
                spent = await base.redis_cpu_s(client) - before
                per[shape][side].append(spent / SCRIPT_CALLS * 1e6)
    return _on_off(per)


#: Decisions per side and round of :func:`script_loop`, in one EVAL.
LOOP_CALLS = 2000

#: admit.lua as the body of a function called LOOP_CALLS times in one EVAL (as
#: claim.lua wraps it): each call decides again, with the same arguments.
_LOOP = """
local function admit_body()
{admit}
end
for _ = 1, tonumber(ARGV[#ARGV]) do admit_body() end
return 1
"""


async def script_loop(client: aioredis.Redis, rounds: int = 9) -> dict[str, dict[str, float]]:
    """Redis's main-thread CPU per decision inside the decision script alone, log
    on and off, the least of ``rounds``: the script looped within one EVAL, so
    neither the network nor the arguments' parsing is in it (they are in
    :func:`script_cpu`)."""
    from turnstile_admission.redis_store import AdmitArgs, script_text
    from turnstile_platform.redis_client import read_script

    admit = read_script("turnstile_admission", "admit.lua")
    body = script_text("admit.lua").replace(admit, _LOOP.format(admit=admit))
    shapes = _shapes()
    context = _log_context()
    per: dict[str, dict[str, list[float]]] = {s: {"on": [], "off": []} for s in shapes}
    for r in range(rounds):
        for shape, (modes, nodes) in shapes.items():
            for side in SIDES if r % 2 == 0 else tuple(reversed(SIDES)):
                prefix = f"loop{side}{r}{shape}:"
                await client.set(LiveCountKeys(prefix).state, COUNTED)
                keys, argv = _store(client, prefix, side).admit_request(
                    AdmitArgs("0" * 32, "acme", "acme--sb-1", modes, nodes, log=context)
                )
                before = await base.redis_cpu_s(client)
                await client.eval(body, len(keys), *keys, *argv, LOOP_CALLS)
                spent = await base.redis_cpu_s(client) - before
                per[shape][side].append(spent / LOOP_CALLS * 1e6)
    # The least of the rounds: the script's own CPU only grows when other work
    # shares the core's caches (medians moved by 10 us at load average 8).
    return _on_off(per, min)


#: Entries of the reading tenant (acme, over 10 sandboxes) and of another (globex)
#: in :func:`read_cost`: more of globex's than one read of the single stream scans.
READ_OWN, READ_OTHER, READ_CALLS = 200, 5_000, 20


async def read_cost(client: aioredis.Redis) -> dict[str, dict[str, float]]:
    """What one ListDecisions read costs (SPEC N3), through the admitter's
    ``decisions`` (no gRPC): Redis main-thread CPU and this process's CPU per read
    (its parsing and filtering, which admission pays), for acme's page of its own,
    acme's read of a sandbox it has no entry for, acme's read of a window with
    only globex's entries in it, and an operator's page of every client's."""
    import time

    from turnstile_admission.admitter import Admitter
    from turnstile_admission.decision_log import Query
    from turnstile_admission.redis_store import AdmitArgs, LogContext
    from turnstile_clientkeys import KeySet, Resolver

    prefix = "reads:"
    await client.set(LiveCountKeys(prefix).state, COUNTED)
    store = _store(client, prefix, "on")
    keyset = KeySet(allowlist=frozenset({"acme", "globex"}))
    admitter = Admitter(_settings(prefix, "on"), store, Resolver(keyset))
    modes, nodes = _shapes()["resume"]
    base_context = _log_context()
    for n in range(READ_OWN + READ_OTHER):
        who = "acme" if n < READ_OWN else "globex"
        context = LogContext(*base_context[:3], who, *base_context[4:])
        await store.admit(
            AdmitArgs(f"{n:032x}", who, f"{who}--sb-{n % 10}", modes, nodes, log=context)
        )
    # A window after acme's entries, before globex's (Redis's clock: the ids).
    newest_own = (await client.xrevrange(f"{prefix}{{adm}}:decisions:k:acme", count=1)) or (
        await client.xrange(f"{prefix}{{adm}}:decisions", count=READ_OWN)
    )
    window_ms = int(newest_own[-1 if len(newest_own) > 1 else 0][0].split(b"-")[0]) + 1
    reads = {
        "own_page": Query(client="acme", limit=100),
        "sandbox_matching_nothing": Query(client="acme", sandbox_id="acme--none", limit=100),
        "window_of_others": Query(client="acme", since_ms=window_ms, limit=100),
        "operator_page": Query(limit=100),
    }
    out: dict[str, dict[str, float]] = {}
    for name, query in reads.items():
        await admitter.decisions(query)  # warm
        before, cpu = await base.redis_cpu_s(client), time.process_time()
        for _ in range(READ_CALLS):
            page = await admitter.decisions(query)
        spent = await base.redis_cpu_s(client) - before
        out[name] = {
            "redis_cpu_us": round(spent / READ_CALLS * 1e6, 1),
            "process_cpu_us": round((time.process_time() - cpu) / READ_CALLS * 1e6, 1),
            "returned": len(page.decisions),
        }
    return out


def _spread(values: list[float], digits: int = 3) -> dict[str, float]:
    return {
        "median": round(statistics.median(values), digits),
        "min": round(min(values), digits),
        "max": round(max(values), digits),
    }


async def run(seconds: float, rounds: int, json_path: str | None) -> None:
    redis_proc = RedisProcess().start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        url = redis_proc.url
        client = aioredis.Redis.from_url(url)
        ports = {name: free_port() for name in ("substrate", "otlp")}
        for name in ("substrate", "otlp"):
            procs.append(base.spawn(name, ports[name], url))
        stubs: dict[str, Any] = {}
        pids: dict[str, int] = {}
        channels = []
        for side in SIDES:
            await client.set(LiveCountKeys(PREFIXES[side]).state, COUNTED)
            port = free_port()
            proc = base.spawn(f"admission-{side}", port, url, _env(port, side, ports, url))
            procs.append(proc)
            pids[side] = proc.pid
            channel = grpc.aio.insecure_channel(f"127.0.0.1:{port}")
            channels.append(channel)
            stubs[side] = admission_pb2_grpc.AdmissionServiceStub(channel)
        makers = base.request_makers()
        per: dict[str, dict[str, list[float]]] = {
            shape: {
                "rps": [],
                "cpu": [],
                "redis_on": [],
                "redis_off": [],
                "script_on": [],
                "script_off": [],
                "total_cpu": [],
            }
            for shape in makers
        }
        for n in range(rounds):
            shapes = list(makers) if n % 2 == 0 else list(reversed(makers))
            for shape in shapes:
                order = SIDES if (n // 2) % 2 == 0 else tuple(reversed(SIDES))
                got: dict[str, dict[str, float]] = {}
                for side in order:
                    call = base._admit(stubs[side], makers[shape])
                    for _ in range(100):  # warm up, outside the script-time counts
                        await call()
                    before = await _evalsha(client)
                    got[side] = await base.measure(
                        call, 64, seconds, pid=pids[side], redis=client, warm_up=0
                    )
                    after = await _evalsha(client)
                    calls = after[0] - before[0]
                    got[side]["script_us"] = (after[1] - before[1]) / calls if calls else 0.0
                per[shape]["rps"].append(got["on"]["rps"] / got["off"]["rps"])
                per[shape]["cpu"].append(got["on"]["cpu_us"] / got["off"]["cpu_us"])
                per[shape]["total_cpu"].append(
                    (got["on"]["cpu_us"] + got["on"]["redis_cpu_us"])
                    / (got["off"]["cpu_us"] + got["off"]["redis_cpu_us"])
                )
                per[shape]["redis_on"].append(got["on"]["redis_cpu_us"])
                per[shape]["redis_off"].append(got["off"]["redis_cpu_us"])
                per[shape]["script_on"].append(got["on"]["script_us"])
                per[shape]["script_off"].append(got["off"]["script_us"])
                print(
                    f"round {n + 1} {shape:6s}: on {got['on']['rps']:7.0f}/s "
                    f"off {got['off']['rps']:7.0f}/s  ratio {per[shape]['rps'][-1]:.3f}  "
                    f"server cpu on/off {per[shape]['cpu'][-1]:.3f}",
                    flush=True,
                )
        out_script = await script_cpu(client)
        out_loop = await script_loop(client)
        out_reads = await read_cost(client)
        # The stream the log-on service logged to: the one (pre-N3) or its key's.
        found = [k async for k in client.scan_iter(match=f"{PREFIXES['on']}{{adm}}:decisions*")]
        streams = [k for k in found if await client.type(k) == b"stream" and b":sb:" not in k]
        stream = max(streams, key=len) if streams else f"{PREFIXES['on']}{{adm}}:decisions"
        length = int(await client.xlen(stream))
        memory = int(await client.memory_usage(stream, samples=0) or 0)
        out: dict[str, Any] = {
            "rounds": rounds,
            "seconds_per_phase": seconds,
            "load_avg_1m": round(os.getloadavg()[0], 2),
            "memory_bytes_per_decision": round(memory / length, 1) if length else None,
            "logged_entries": length,
            "script_cpu": out_script,
            "script_loop": out_loop,
            "reads": out_reads,
        }
        for shape, values in per.items():
            on, off = values["redis_on"], values["redis_off"]
            out[shape] = {
                "rps_on_per_off": _spread(values["rps"]),
                "server_cpu_on_per_off": _spread(values["cpu"]),
                "cpu_on_per_off": _spread(values["total_cpu"]),
                "redis_cpu_us_per_decision_on": _spread(on, 1),
                "redis_cpu_us_per_decision_off": _spread(off, 1),
                "redis_cpu_us_per_logged_decision": round(
                    statistics.median(on) - statistics.median(off), 1
                ),
                "script_us_on": _spread(values["script_on"], 1),
                "script_us_off": _spread(values["script_off"], 1),
                "script_us_per_logged_decision": round(
                    statistics.median(values["script_on"])
                    - statistics.median(values["script_off"]),
                    1,
                ),
            }
        for shape in makers:
            s = out[shape]
            print(
                f"{shape:6s} log on ÷ off: calls/s {s['rps_on_per_off']['median']:.3f} "
                f"({s['rps_on_per_off']['min']:.3f}-{s['rps_on_per_off']['max']:.3f}), "
                f"server CPU/call {s['server_cpu_on_per_off']['median']:.3f}, "
                f"server + Redis CPU/call {s['cpu_on_per_off']['median']:.3f}, "
                f"Redis CPU/decision {s['redis_cpu_us_per_decision_on']['median']:.1f} vs "
                f"{s['redis_cpu_us_per_decision_off']['median']:.1f} us, "
                f"script {s['script_us_on']['median']:.1f} vs {s['script_us_off']['median']:.1f} us"
            )
        for shape, cpu in out_script.items():
            print(
                f"{shape:6s} Redis CPU per decision, one at a time: log on {cpu['on_us']} us, "
                f"off {cpu['off_us']} us: +{cpu['per_logged_decision_us']} us per logged decision"
            )
        for shape, cpu in out_loop.items():
            print(
                f"{shape:6s} Redis CPU per decision, the script alone: log on {cpu['on_us']} us, "
                f"off {cpu['off_us']} us: +{cpu['per_logged_decision_us']} us per logged decision"
            )
        for name, cost in out_reads.items():
            print(
                f"read {name:24s}: Redis {cost['redis_cpu_us']} us, this process "
                f"{cost['process_cpu_us']} us per read ({cost['returned']} returned)"
            )
        print(
            f"memory per logged decision: {out['memory_bytes_per_decision']} bytes "
            f"({length} entries)"
        )
        line = json.dumps(out, sort_keys=True)
        print(line)
        if json_path:
            with open(json_path, "w") as out_file:  # noqa: ASYNC230 - once, at the end
                out_file.write(line + "\n")
        for channel in channels:
            await channel.close(None)
        await client.aclose()
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)
        redis_proc.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=2.0, help="per phase")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--json", metavar="PATH", help="also write the JSON summary to PATH")
    args = parser.parse_args()
    uvloop.run(run(args.seconds, args.rounds, args.json))


if __name__ == "__main__":
    main()
