"""turnstilectl start-up: ``--help`` and one command, beside ``python -c pass``.

    uv run python tools/turnstilectl/bench/cli_startup.py [--runs 9]

Each is a fresh process, run ``--runs`` times, interleaved so that load changes on
a shared machine hit all of them alike:

* ``python -c pass``     — the interpreter's own start-up: the floor;
* ``turnstilectl --help`` — parsing only (goal: under 0.3 s);
* ``turnstilectl status`` — a whole command: three health RPCs, with its trace,
  against a real gRPC server this benchmark runs (the platform bootstrap,
  answering SERVING for the three service names), goal: under 0.6 s;
* ``turnstilectl usage``  — one admission RPC through the path every service
  command takes (contracts, peer channel with its interceptors, the trace, the
  rich error decoded and rendered: the bench server answers UNIMPLEMENTED, exit 1),
  goal: under 0.6 s.

Everything runs over mutual TLS with an authorization policy, as a user's stack does:
the benchmark issues its own CA and certificates (``turnstile_platform.pki``) in a
temporary directory.

Reported: median and best wall time of each, the median minus the floor, and the
median CPU time (user + system, which moves less than wall time when the machine
is shared), with the load average before and after (a 2-core machine shared with
others moves 2× and more).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from turnstile_platform import peers
from turnstile_platform.pki import LocalIdentity, ensure_local_pki
from turnstile_platform.server import GrpcService
from turnstile_platform.settings import ServiceSettings

CLI = str(Path(sys.executable).with_name("turnstilectl"))
GOALS = {"--help": 0.3, "status": 0.6, "usage": 0.6}
#: Exit codes each case may end with (usage meets an UNIMPLEMENTED admission).
EXPECTED = {"usage": {1}}


POLICY = """
[[allow]]
identities = ["spiffe://turnstile.local/operator/bench"]
methods = ["*"]
clients = "any"
"""


def _serve(
    ready: threading.Event,
    port: list[int],
    stop: threading.Event,
    server: LocalIdentity,
    ca: Path,
    policy: Path,
) -> None:
    async def main() -> None:
        settings = ServiceSettings(
            port=0,
            shutdown_grace_s=1,
            tls_cert_file=server.cert_file,
            tls_key_file=server.key_file,
            tls_ca_file=ca,
            authz_policy_file=policy,
        )
        app = GrpcService(
            "bench", settings, service_names=[peers.ADMISSION, peers.SUBSTRATE, peers.AFFINITY]
        )
        port.append(await app.start())
        ready.set()
        await asyncio.to_thread(stop.wait)
        await app.stop()

    asyncio.run(main())


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _time(argv: list[str], env: dict[str, str], expected: set[int]) -> tuple[float, float]:
    """Wall time and CPU time (user + system) of one run."""
    cpu = _cpu()
    started = time.perf_counter()
    done = subprocess.run(argv, env=env, capture_output=True, check=False)
    elapsed = time.perf_counter() - started
    cpu = _cpu() - cpu
    if done.returncode not in expected:
        raise SystemExit(f"{argv} exited {done.returncode}: {done.stderr.decode()[-500:]}")
    return elapsed, cpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=9)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        run(args.runs, Path(tmp))


def run(runs: int, tls_dir: Path) -> None:
    # The server holds admission's identity: the CLI checks it (SPEC O5).
    ca, holders = ensure_local_pki(
        tls_dir,
        "turnstile.local",
        {"server": "service/admission", "cli": "operator/bench"},
        servers={"server"},
    )
    policy = tls_dir / "policy.toml"
    policy.write_text(POLICY)
    ready, stop = threading.Event(), threading.Event()
    port: list[int] = []
    server = threading.Thread(
        target=_serve, args=(ready, port, stop, holders["server"], ca, policy), daemon=True
    )
    server.start()
    if not ready.wait(30):
        raise SystemExit("the benchmark's server did not start")
    address = f"127.0.0.1:{port[0]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
    env |= {
        "TURNSTILE_TLS_CERT_FILE": str(holders["cli"].cert_file),
        "TURNSTILE_TLS_KEY_FILE": str(holders["cli"].key_file),
        "TURNSTILE_TLS_CA_FILE": str(ca),
        # One server stands for all three services: the CLI is told to expect it.
        **{
            f"TURNSTILE_{service}_SPIFFE_ID": holders["server"].spiffe_id
            for service in ("ADMISSION", "SUBSTRATE", "AFFINITY")
        },
    }
    cases = {
        "python -c pass": [sys.executable, "-c", "pass"],
        "--help": [CLI, "--help"],
        "status": [
            CLI,
            "status",
            "--admission",
            address,
            "--substrate",
            address,
            "--affinity",
            address,
        ],
        "usage": [CLI, "usage", "--client", "bench", "--admission", address],
    }
    load_before = os.getloadavg()[0]
    for name, argv in cases.items():  # warm the page cache and .pyc files
        _time(argv, env, EXPECTED.get(name, {0}))
    times: dict[str, list[float]] = {name: [] for name in cases}
    cpus: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, argv in cases.items():
            wall, cpu = _time(argv, env, EXPECTED.get(name, {0}))
            times[name].append(wall)
            cpus[name].append(cpu)
    load_after = os.getloadavg()[0]
    stop.set()
    server.join(10)
    floor = statistics.median(times["python -c pass"])
    print(f"runs: {runs} each, interleaved; load average {load_before:.2f} → {load_after:.2f}")
    print(f"{'case':<16}{'median':>9}{'best':>9}{'− floor':>10}{'cpu':>9}{'goal':>8}")
    for name, samples in times.items():
        median = statistics.median(samples)
        goal = GOALS.get(name)
        print(
            f"{name:<16}{median:>8.3f}s{min(samples):>8.3f}s{median - floor:>9.3f}s"
            f"{statistics.median(cpus[name]):>8.3f}s" + (f"{goal:>7.1f}s" if goal else f"{'':>8}")
        )


if __name__ == "__main__":
    main()
