"""What sandbox ownership (SPEC O1) costs Activate: one substrate over mutual TLS with
the authorization policy, called in interleaved rounds by

* ``any``     — ``operator/ops``, allowed every client: no ownership check at all;
* ``self``    — ``client/acme`` scoped to ``self``, on ids of its own namespace
  (``acme--…``): the authorizer checks the id's namespace, the activation checks
  the record it reads anyway — no extra query;
* ``self+lookup`` — the same identity on old ids of no namespace recorded to it:
  the authorizer looks the owner up (one PostgreSQL read) before the handler.

    uv run python services/substrate/bench/activate_ownership.py [--database-url URL]

The figures are Activate of running sandboxes (``ALREADY_RUNNING``, the hot path),
64 in flight, in short blocks taken in turn (any, self, self+lookup, any, …), as
calls/s and as this process's CPU time per call (client and server both run here:
CPU time is steadier than wall time on a shared machine); and cold activations (a
process start each) for ``any`` and ``self``. Ratios are per block, reported as
median and range. Admission is a stand-in that admits everything. Takes about two
minutes.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable
from datetime import UTC, datetime
from pathlib import Path

import asyncpg
import grpc.aio

from turnstile_contracts import admission_pb2_grpc, common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform import tls
from turnstile_platform.authz.authorizer import Authorizer
from turnstile_platform.authz.methods import CLIENT_SOURCES, refusal
from turnstile_platform.authz.ownership import current_scope, enter_scope
from turnstile_platform.authz.policy import ALLOW_ALL, AuthzDecision
from turnstile_substrate.activation import check_owner
from turnstile_substrate.app import create_app
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.db.records import SandboxRecord
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.pki import Pki

sys.path.insert(0, str(Path(__file__).parent))
from activate import IN_FLIGHT, AdmitAll, bench_settings, rate  # the sibling benchmark

TD = "spiffe://turnstile.test"
SERVICE = "turnstile.substrate.v1.SubstrateService"
POLICY = f"""
[[allow]]
identities = ["{TD}/operator/*"]
methods = ["*"]
clients = "any"

[[allow]]
identities = ["{TD}/client/*"]
methods = ["{SERVICE}/Activate", "{SERVICE}/Deactivate", "{SERVICE}/GetSandbox"]
clients = "self"
"""
SANDBOXES = 200
BLOCKS = 15
BLOCK_CALLS = 500
COLD_ROUNDS = 4
COLD_CALLS = 30


async def check_alone(calls: int = 200_000) -> float:
    """µs per call of what ownership adds to a scoped Activate, alone: the authorizer's
    refusal check (namespace, no lookup), the scope handed to the handler, and the
    handler's check of the record (:func:`check_owner`) — no I/O, so it is measured
    exactly here and set against an Activate's CPU time below."""
    decision = AuthzDecision(True, clients=frozenset({"acme"}), label="client/*")
    authorizer = Authorizer(_Policy())
    method = f"/{SERVICE}/Activate"
    source = CLIENT_SOURCES[method]
    request = substrate_pb2.ActivateRequest(
        sandbox_id="acme--1", client=common_pb2.ActivationClient(client_id="acme")
    )
    now = datetime.now(UTC)
    record = SandboxRecord("acme--1", "default", "running", "direct", "acme", now, now, None)
    identity = f"{TD}/client/acme"
    started = time.perf_counter()
    for _ in range(calls):
        if await refusal(source, request, decision, None) is not None:
            raise AssertionError("refused")
        enter_scope(authorizer._scope(identity, method, decision))
        check_owner(current_scope(), "acme--1", record, None, recorded_only=False)
    return (time.perf_counter() - started) / calls * 1e6


class _Policy:
    policy = ALLOW_ALL


async def main(database_url: str) -> None:
    base, _, _ = database_url.rpartition("/")
    name = f"bench_{uuid.uuid4().hex[:12]}"
    admin = await asyncpg.connect(database_url)
    await admin.execute(f'CREATE DATABASE "{name}"')
    url = f"{base}/{name}"
    state = Path(tempfile.mkdtemp(prefix="turnstile-bench-"))
    pki = Pki(state / "pki")
    me = pki.identity("service/admission")
    admission = grpc.aio.server()
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(AdmitAll(), admission)
    files = tls.TlsFiles(me.cert_file, me.key_file, me.ca_file)
    admission_port = admission.add_secure_port("127.0.0.1:0", tls.server_credentials(files))
    await admission.start()
    channels: list[grpc.aio.Channel] = []
    try:
        await asyncio.to_thread(apply_migrations, url)
        plain = bench_settings(url, admission_port, state / "direct").model_dump()
        worker = pki.identity("sandbox")
        settings = SubstrateSettings.model_validate(
            {
                **plain,
                "direct_worker_tls_cert_file": worker.cert_file,
                "direct_worker_tls_key_file": worker.key_file,
                **pki.server_settings("service/substrate", policy=POLICY),
            }
        )
        app = await create_app(settings)
        await app.start()
        stubs = {}
        for who, path in (("any", "operator/ops"), ("self", "client/acme")):
            channel = pki.identity(path).channel(app.address)
            channels.append(channel)
            stubs[who] = substrate_pb2_grpc.SubstrateServiceStub(channel)
        acme = common_pb2.ActivationClient(client_id="acme")

        def activate(who: str, sandbox_id: str) -> Awaitable[object]:
            request = substrate_pb2.ActivateRequest(sandbox_id=sandbox_id, client=acme)
            return stubs[who].Activate(request, timeout=30)

        # The running sandboxes: namespaced ones, and old ids of no namespace, all acme's.
        await rate(lambda i: activate("any", f"acme--{i}"), SANDBOXES, 16)
        await rate(lambda i: activate("any", f"old-{i}"), SANDBOXES, 16)

        modes = {
            "any": lambda i: activate("any", f"acme--{i % SANDBOXES}"),
            "self": lambda i: activate("self", f"acme--{i % SANDBOXES}"),
            "self+lookup": lambda i: activate("self", f"old-{i % SANDBOXES}"),
        }
        hot: dict[str, list[float]] = {mode: [] for mode in modes}
        cpu: dict[str, list[float]] = {mode: [] for mode in modes}
        await rate(modes["any"], 1000, IN_FLIGHT)  # warm-up
        for block in range(BLOCKS):
            # The order flips every block, so neither mode always follows the other.
            order = list(modes.items()) if block % 2 == 0 else list(modes.items())[::-1]
            for mode, call in order:
                started = time.process_time()
                hot[mode].append(await rate(call, BLOCK_CALLS, IN_FLIGHT))
                cpu[mode].append((time.process_time() - started) / BLOCK_CALLS * 1e6)
        cold: dict[str, list[float]] = {"any": [], "self": []}
        for round_ in range(COLD_ROUNDS):
            # Flipped every round too: each block leaves more runtimes running, which
            # slows the next block's process starts.
            for who in list(cold) if round_ % 2 == 0 else list(cold)[::-1]:
                ids = [f"acme--cold-{who}-{round_}-{i}" for i in range(COLD_CALLS)]

                def create(i: int, who: str = who, ids: list[str] = ids) -> Awaitable[object]:
                    return activate(who, ids[i])

                cold[who].append(await rate(create, COLD_CALLS, 16))
        made = [f"acme--{i}" for i in range(SANDBOXES)] + [f"old-{i}" for i in range(SANDBOXES)]
        made += [
            f"acme--cold-{w}-{r}-{i}"
            for w in cold
            for r in range(COLD_ROUNDS)
            for i in range(COLD_CALLS)
        ]

        def deactivate(i: int) -> Awaitable[object]:
            request = substrate_pb2.DeactivateRequest(sandbox_id=made[i])
            return stubs["any"].Deactivate(request, timeout=30)

        await rate(deactivate, len(made), 16)
        await app.stop()

        def ratios(numbers: list[float], against: list[float]) -> str:
            each = sorted(a / b for a, b in zip(numbers, against, strict=True))
            return f"{statistics.median(each):.3f} (range {each[0]:.3f}–{each[-1]:.3f})"

        print(
            f"Activate over mTLS, {BLOCKS} interleaved blocks of {BLOCK_CALLS} calls"
            f" ({IN_FLIGHT} in flight); ratios per block, median (range):"
        )
        for mode, numbers in hot.items():
            print(
                f"  ALREADY_RUNNING, {mode:12s} {statistics.median(numbers):6.0f} calls/s"
                f"  ÷ any = {ratios(numbers, hot['any'])};"
                f"  {statistics.median(cpu[mode]):5.0f} µs CPU/call"
                f"  ÷ any = {ratios(cpu[mode], cpu['any'])}"
            )
        alone = statistics.median([await check_alone() for _ in range(3)])
        share = alone / statistics.median(cpu["any"])
        print(
            f"  the ownership check alone: {alone:.2f} µs/call"
            f" = {share:.2%} of an Activate's CPU time (ALREADY_RUNNING, any)"
        )
        for who, numbers in cold.items():
            print(
                f"  cold create,     {who:12s} {statistics.median(numbers):6.1f} activations/s"
                f"  ÷ any = {ratios(numbers, cold['any'])}"
            )
    finally:
        for channel in channels:
            await channel.close(None)
        await admission.stop(None)
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        await admin.close()
        shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--database-url", default="postgresql://postgres@127.0.0.1:5432/postgres")
    asyncio.run(main(parser.parse_args().database_url))
