"""The Direct substrate on its own: real processes, their groups, their records."""

from __future__ import annotations

import asyncio
import json
import os
import shlex
import stat
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

import grpc
import pytest
import redis.asyncio as aioredis

from turnstile_platform.errors import RichError
from turnstile_platform.sandbox_credentials import (
    CredentialIssuer,
    PresenceClaims,
    SigningKey,
    VerificationKeys,
    credential_key,
)
from turnstile_substrate.direct import processes
from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.runtime import CountUnknown, CreateKind, RuntimeSpec
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.plugin import CredentialKeyFiles

IDLE = f"{sys.executable} -m turnstile_substrate.direct.idle_runtime"


async def no_gate() -> None:
    return None


def settings(state_dir: Path, command: str = IDLE, **extra: object) -> SubstrateSettings:
    return SubstrateSettings(
        direct_state_dir=state_dir,
        direct_runtime_command=command,
        # These tests are about processes, not uids (test_substrate_direct_secrets.py).
        direct_runtime_user=str(os.getuid()),
        affinity_addr="127.0.0.1:50999",
        **extra,  # type: ignore[arg-type]
    )


def spec(sandbox_id: str = "sb-1", *, label: str | None = "acme", tier: str = "") -> RuntimeSpec:
    return RuntimeSpec(sandbox_id=sandbox_id, tier=tier, client_label=label)


@pytest.fixture
async def direct(state_dir: Path) -> AsyncIterator[DirectSubstrate]:
    substrate = DirectSubstrate(settings(state_dir))
    await substrate.start()
    try:
        yield substrate
    finally:
        await substrate.close()


class Rendezvous:
    """A socket a runtime connects to and reports on, so a test awaits the
    runtime being ready (an event) instead of sleeping."""

    def __init__(self) -> None:
        self.lines: asyncio.Queue[str] = asyncio.Queue()
        self.port = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> Rendezvous:
        async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            line = await reader.readline()
            await self.lines.put(line.decode().strip())
            writer.close()

        self._server = await asyncio.start_server(handle, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def next(self) -> str:
        async with asyncio.timeout(10):
            return await self.lines.get()

    def command(self, body: str) -> str:
        """A runtime that runs ``body`` (Python), then reports ``report`` and idles."""
        program = (
            "import os, signal, socket, subprocess, sys, time\n"
            f"{body}\n"
            f"rendezvous = socket.create_connection(('127.0.0.1', {self.port}))\n"
            "rendezvous.sendall(report.encode() + b'\\n')\n"
            "while True: time.sleep(3600)\n"
        )
        return f"{sys.executable} -c {shlex.quote(program)}"


async def test_start_runs_the_command_in_the_workspace_with_the_worker_settings(
    state_dir: Path,
) -> None:
    async with Rendezvous() as rendezvous:
        body = (
            "report = '|'.join([os.getcwd(), os.environ['TURNSTILE_WORKER_SANDBOX_ID'],"
            " repr(os.environ['TURNSTILE_WORKER_TIER']), os.environ['TURNSTILE_WORKER_CAPACITY'],"
            " os.environ['TURNSTILE_AFFINITY_ADDR'], os.environ['TURNSTILE_AFFINITY_SPIFFE_ID'],"
            " str(os.getpgid(0) == os.getpid())])"
        )
        substrate = DirectSubstrate(
            settings(
                state_dir,
                rendezvous.command(body),
                direct_worker_capacity=3,
                affinity_spiffe_id="spiffe://example.test/service/relay",
            )
        )
        await substrate.start()
        try:
            runtime = await substrate.ensure_runtime(spec(), substrate.plan(spec()), no_gate)
            report = await rendezvous.next()
        finally:
            await substrate.close()

    workspace = state_dir / "sb-1" / "workspace"
    assert report.split("|") == [
        str(workspace),
        "sb-1",
        "''",
        "3",
        "127.0.0.1:50999",
        "spiffe://example.test/service/relay",  # the relay it must find (SPEC O5)
        "True",
    ]
    assert runtime.kind is CreateKind.COLD
    assert runtime.client_label == "acme"


async def test_a_restarted_substrate_finds_and_stops_runtimes_that_outlived_it(
    state_dir: Path,
) -> None:
    first = DirectSubstrate(settings(state_dir))
    await first.start()
    runtime = await first.ensure_runtime(spec(), first.plan(spec()), no_gate)
    await first.close()
    pid = int(runtime.name.removeprefix("proc-"))
    ticks = processes.start_ticks(pid)
    assert ticks is not None

    second = DirectSubstrate(settings(state_dir))
    await second.start()
    try:
        found = await second.find_running("sb-1")
        assert found == runtime
        assert await second.stop_runtime("sb-1")
    finally:
        await second.close()
    assert processes.start_ticks(pid) is None
    assert not (state_dir / "sb-1" / "runtime.json").exists()


async def test_a_runtime_that_ignores_sigterm_is_killed_after_the_grace(state_dir: Path) -> None:
    async with Rendezvous() as rendezvous:
        body = "signal.signal(signal.SIGTERM, signal.SIG_IGN)\nreport = str(os.getpid())"
        substrate = DirectSubstrate(
            settings(state_dir, rendezvous.command(body), direct_stop_grace_s=0.3)
        )
        await substrate.start()
        try:
            await substrate.ensure_runtime(spec(), substrate.plan(spec()), no_gate)
            pid = int(await rendezvous.next())
            loop = asyncio.get_running_loop()
            started = loop.time()
            assert await substrate.stop_runtime("sb-1")
            elapsed = loop.time() - started
        finally:
            await substrate.close()

    assert processes.start_ticks(pid) is None
    assert 0.3 <= elapsed < 5


async def test_stopping_a_runtime_stops_the_processes_it_started(state_dir: Path) -> None:
    async with Rendezvous() as rendezvous:
        body = (
            "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
            "report = str(child.pid)"
        )
        substrate = DirectSubstrate(settings(state_dir, rendezvous.command(body)))
        await substrate.start()
        try:
            await substrate.ensure_runtime(spec(), substrate.plan(spec()), no_gate)
            child = int(await rendezvous.next())
            child_ticks = processes.start_ticks(child)
            assert child_ticks is not None
            assert await substrate.stop_runtime("sb-1")
        finally:
            await substrate.close()

    assert await processes.wait_exit(child, child_ticks, 5)


async def test_a_reused_pid_is_not_running_and_is_never_signalled(
    direct: DirectSubstrate, state_dir: Path
) -> None:
    stranger = await asyncio.create_subprocess_exec("sleep", "60", start_new_session=True)
    try:
        ticks = processes.start_ticks(stranger.pid)
        assert ticks is not None
        record = state_dir / "sb-1" / "runtime.json"
        record.parent.mkdir(parents=True)
        record.write_text(
            json.dumps(
                {
                    "pid": stranger.pid,
                    "start_ticks": ticks + 1,  # started at another time: another process
                    "name": f"proc-{stranger.pid}",
                    "kind": "cold",
                    "client_label": "acme",
                    "tier": "",
                    "started_at": "2026-01-01T00:00:00+00:00",
                }
            )
        )

        assert await direct.find_running("sb-1") is None
        assert not await direct.stop_runtime("sb-1")
        assert processes.is_alive(stranger.pid, ticks)
        assert not record.exists()
    finally:
        stranger.kill()
        await stranger.wait()


async def test_a_cap_gate_refusal_starts_nothing(direct: DirectSubstrate, state_dir: Path) -> None:
    async def refuse() -> None:
        raise RichError(grpc.StatusCode.RESOURCE_EXHAUSTED, "cap", reason="CAP_EXCEEDED")

    with pytest.raises(RichError):
        await direct.ensure_runtime(spec(), direct.plan(spec()), refuse)

    assert await direct.find_running("sb-1") is None
    assert not (state_dir / "sb-1").exists()


async def test_a_start_cancelled_half_way_leaves_no_process(
    direct: DirectSubstrate, state_dir: Path
) -> None:
    gate_passed = asyncio.Event()

    async def gate() -> None:
        gate_passed.set()

    starting = asyncio.create_task(direct.ensure_runtime(spec(), direct.plan(spec()), gate))
    await gate_passed.wait()
    starting.cancel()

    with pytest.raises(asyncio.CancelledError):
        await starting
    assert await direct.find_running("sb-1") is None
    assert not (state_dir / "sb-1" / "runtime.json").exists()


async def test_a_restore_keeps_the_workspace_and_a_cold_start_clears_it(
    direct: DirectSubstrate, state_dir: Path
) -> None:
    await direct.ensure_runtime(spec(), direct.plan(spec()), no_gate)
    (direct.workspace("sb-1") / "work.txt").write_text("x")
    await direct.stop_runtime("sb-1")

    restore = RuntimeSpec("sb-1", "", "acme", restore=True)
    runtime = await direct.ensure_runtime(restore, direct.plan(restore), no_gate)
    assert runtime.kind is CreateKind.RESTORE
    assert (direct.workspace("sb-1") / "work.txt").exists()
    await direct.stop_runtime("sb-1")

    await direct.ensure_runtime(spec(), direct.plan(spec()), no_gate)
    assert not (direct.workspace("sb-1") / "work.txt").exists()
    await direct.stop_runtime("sb-1")


def test_counts_are_unknown_because_direct_cannot_count(state_dir: Path) -> None:
    count = DirectSubstrate(settings(state_dir)).count_live("acme", None, ["sb-1"])
    assert isinstance(count, CountUnknown)
    assert count.reason == "unsupported"


def test_the_idle_runtime_exits_cleanly_on_sigterm() -> None:
    program = (
        "import os, signal, sys\n"
        "from turnstile_substrate.direct import idle_runtime\n"
        "signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})\n"
        "os.kill(os.getpid(), signal.SIGTERM)  # pending until the runtime waits for it\n"
        "sys.exit(idle_runtime.main())\n"
    )
    completed = subprocess.run([sys.executable, "-c", program], timeout=10, check=False)
    assert completed.returncode == 0  # a clean exit, not death by SIGTERM (-15)


# -- sandbox credentials (SPEC Z3) ----------------------------------------------


@pytest.fixture
def issuer(
    redis: aioredis.Redis, redis_prefix: str, credential_keys: CredentialKeyFiles
) -> CredentialIssuer:
    signing = SigningKey.from_file(credential_keys.signing_key_file)
    return CredentialIssuer(signing, redis, redis_prefix, ttl_s=3600)


async def test_each_runtime_start_hands_its_process_a_private_credential_of_a_new_generation(
    state_dir: Path,
    issuer: CredentialIssuer,
    credential_keys: CredentialKeyFiles,
    redis: aioredis.Redis,
    redis_prefix: str,
) -> None:
    keys = VerificationKeys(credential_keys.public_keys_file)
    record = credential_key(redis_prefix, "sb-1")
    async with Rendezvous() as rendezvous:
        # The runtime itself reads the file its environment names.
        body = "report = open(os.environ['TURNSTILE_WORKER_CREDENTIAL_FILE']).read()"
        substrate = DirectSubstrate(settings(state_dir, rendezvous.command(body)), issuer)
        await substrate.start()
        try:
            await substrate.ensure_runtime(spec(), substrate.plan(spec()), no_gate)
            seen = await rendezvous.next()
            path = state_dir / "sb-1" / "credential"
            assert stat.S_IMODE(path.stat().st_mode) == 0o600
            claims = keys.verify(seen, "sb-1")
            assert await redis.get(record) == claims.generation.encode()
            # SPEC O3: what the substrate started (Direct assigns no endpoint).
            assert claims.presence == PresenceClaims(spec().client_label or "", spec().tier, 1, "")
            saved = json.loads((state_dir / "sb-1" / "runtime.json").read_text())
            assert saved["generation"] == claims.generation

            await substrate.stop_runtime("sb-1")
            assert await redis.get(record) == b"revoked"
            assert not path.exists()

            restore = RuntimeSpec(sandbox_id="sb-1", tier="", client_label="acme", restore=True)
            await substrate.ensure_runtime(restore, substrate.plan(restore), no_gate)
            again = keys.verify(await rendezvous.next(), "sb-1")
            assert again.generation != claims.generation
            assert await redis.get(record) == again.generation.encode()
            await substrate.stop_runtime("sb-1")
        finally:
            await substrate.close()


async def test_renewal_re_mints_credentials_past_half_their_ttl_unless_revoked(
    state_dir: Path,
    issuer: CredentialIssuer,
    credential_keys: CredentialKeyFiles,
) -> None:
    keys = VerificationKeys(credential_keys.public_keys_file)
    substrate = DirectSubstrate(settings(state_dir), issuer)
    await substrate.start()
    try:
        await substrate.ensure_runtime(spec("sb-1"), substrate.plan(spec("sb-1")), no_gate)
        await substrate.ensure_runtime(spec("sb-2"), substrate.plan(spec("sb-2")), no_gate)
        first = {sb: (state_dir / sb / "credential").read_text() for sb in ("sb-1", "sb-2")}
        assert await substrate.renew_credentials(issuer) == 0  # fresh: not due yet

        aged = time.time() - 1900  # past half of the 3600 s ttl
        for sb in ("sb-1", "sb-2"):
            os.utime(state_dir / sb / "credential", (aged, aged))
        await issuer.revoke("sb-2")  # revoked under a running runtime: never renewed
        assert await substrate.renew_credentials(issuer) == 1
        renewed = keys.verify((state_dir / "sb-1" / "credential").read_text(), "sb-1")
        before = keys.verify(first["sb-1"], "sb-1")
        assert renewed.presence == before.presence is not None  # re-attested from the record
        assert renewed.generation == before.generation
        assert renewed.expires_ms > before.expires_ms
        assert (state_dir / "sb-2" / "credential").read_text() == first["sb-2"]
        assert await substrate.renew_credentials(issuer) == 0  # idempotent
    finally:
        for sb in ("sb-1", "sb-2"):
            await substrate.stop_runtime(sb)
        await substrate.close()
