"""Every command acts on a stack it was pointed at and names it (SPEC M2): two
checkouts' stacks on one machine, each checkout's commands reach its own, none
reaches the other's unasked, a stopped one is reported as stopped, and outside
any checkout the command lists the stacks and how to choose one."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from turnstile_cli.stack import state
from turnstile_clientkeys.limits import LimitsStore
from turnstile_platform.server import GrpcService
from turnstile_testing.probe import settings
from turnstile_testing.stack import run_stack

CONSOLE_SCRIPT = Path(sys.executable).parent / "turnstilectl"


def _bare_env(state_home: Path) -> dict[str, str]:
    """A new terminal's environment: no TURNSTILE_* variable at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
    return {**env, "XDG_STATE_HOME": str(state_home), "COLUMNS": "300"}


def _cli(
    argv: list[str], *, cwd: Path, env: dict[str, str], program: list[str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [*(program or [sys.executable, "-m", "turnstile_cli"]), *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
async def probe() -> AsyncIterator[str]:
    """A plaintext gRPC server answering health: the other checkout's "stack"."""
    app = GrpcService("probe", settings(plaintext=True), service_names=[])
    await app.start()
    try:
        yield app.address
    finally:
        await app.stop()


@pytest.fixture
def other_runner() -> Iterator[subprocess.Popen[bytes]]:
    """A live process standing for checkout two's runner (its stack stops when it does)."""
    runner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        yield runner
    finally:
        runner.kill()
        runner.wait()


def _publish_other(checkout: Path, address: str, runner: subprocess.Popen[bytes]) -> None:
    """Describe checkout B's stack as ``up`` does: its ``.run/stack.json``, and the
    user's registry, where it becomes the current stack (started last)."""
    record = state.process_record(runner.pid)
    description = {
        "pid": runner.pid,
        "runner": record,
        "state_dir": str(checkout / ".run" / "direct"),
        "addresses": {"admission": address, "substrate": address, "affinity": address},
        "transport": {"mode": "plaintext"},
        "redis_url": "redis://127.0.0.1:6379/15",
        "redis_prefix": "turnstile:other000:",
    }
    state.write(checkout / ".run" / "stack.json", description)
    state.publish(description)


async def test_two_checkouts_stacks_each_acts_on_its_own_and_a_stopped_one_says_so(
    tmp_path: Path,
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    redis: aioredis.Redis,
    probe: str,
    other_runner: subprocess.Popen[bytes],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    runner = other_runner
    one, two, elsewhere = tmp_path / "one", tmp_path / "two", tmp_path / "elsewhere"
    for directory in (one / ".run", one / "docs", two / ".run", elsewhere):
        directory.mkdir(parents=True)
    with run_stack(
        one / ".run",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
    ) as stack:
        await stack.wait_serving()
        assert stack.state_home is not None
        env = _bare_env(stack.state_home)
        monkeypatch.setenv("XDG_STATE_HOME", str(stack.state_home))
        _publish_other(two, probe, runner)

        async def cli(
            argv: list[str], cwd: Path, program: list[str] | None = None
        ) -> subprocess.CompletedProcess[str]:
            return await asyncio.to_thread(_cli, argv, cwd=cwd, env=env, program=program)

        # In checkout one (a subdirectory of it): its own stack, named first.
        status = await cli(["status"], one / "docs")
        assert status.returncode == 0, status.stderr
        first = status.stdout.splitlines()[0]
        assert first.startswith(f"target: the stack of {one} (this checkout) at 127.0.0.1:")
        assert stack.addresses[0] in status.stdout
        # In checkout two: its own, though one's is running too.
        status = await cli(["--json", "status"], two)
        assert status.returncode == 0, status.stderr
        answer = json.loads(status.stdout)
        assert answer["admission"] == {"address": probe, "health": "SERVING"}
        assert answer["target"]["checkout"] == str(two)
        # Every other command names its target on stderr in one line; -q hushes it.
        usage = await cli(["usage", "--client", "acme", "-o", "json"], one)
        assert usage.returncode == 0, usage.stderr
        assert usage.stderr.startswith(f"target: the stack of {one} (this checkout)")
        quiet = await cli(["usage", "--client", "acme", "-o", "json", "-q"], one)
        assert (quiet.returncode, quiet.stderr) == (0, "")

        # Outside any checkout, nothing given: both listed, and how to choose.
        lost = await cli(["usage", "--client", "acme"], elsewhere)
        assert lost.returncode == 2
        assert lost.stdout == ""
        for checkout in (one, two):
            assert str(checkout) in lost.stderr
        assert "--stack" in lost.stderr
        assert "TURNSTILE_STACK=" in lost.stderr
        lost = await cli(["--json", "status"], elsewhere)
        error = json.loads(lost.stdout)["error"]
        assert error["reason"] == "NO_TARGET"
        assert {s["checkout"] for s in error["stacks"]} == {str(one), str(two)}
        # Chosen by flag (after the verb) or variable: that one.
        chosen = await cli(["status", "--json", "--stack", str(one)], elsewhere)
        assert chosen.returncode == 0, chosen.stderr
        assert json.loads(chosen.stdout)["admission"]["address"] == stack.addresses[0]
        by_variable = await asyncio.to_thread(
            _cli, ["--json", "status"], cwd=elsewhere, env={**env, "TURNSTILE_STACK": str(two)}
        )
        assert json.loads(by_variable.stdout)["admission"]["address"] == probe

        # Checkout two's stack stops; one's becomes the user's current one.
        runner.kill()
        runner.wait()
        state.retire(runner.pid)
        assert (state.read(state.user_file()) or {}).get("pid") == stack.proc.pid
        stopped = f"no stack running for {two}; start it with ./scripts/up"
        for cwd, argv, program in (
            (two, ["status"], None),
            (two, ["limits", "set", "--default", '{"cap": 7}'], None),
            # Its own console script, run from elsewhere, is checkout two's.
            (elsewhere, ["usage", "--client", "acme"], [str(two / ".venv/bin/turnstilectl")]),
            # Named from elsewhere: stopped, not "mutual TLS needs TLS_CERT_FILE".
            (elsewhere, ["usage", "--client", "acme", "--stack", str(two)], None),
        ):
            if program is not None:
                (two / ".venv" / "bin").mkdir(parents=True, exist_ok=True)
                shutil.copy(CONSOLE_SCRIPT, two / ".venv" / "bin" / "turnstilectl")
            done = await cli(argv, cwd, program=program)
            assert done.returncode == 4, (argv, done.stdout, done.stderr)
            assert stopped in " ".join(done.stderr.split()), done.stderr
            assert "TLS_CERT_FILE" not in done.stderr
            assert f"--stack {one}" in done.stderr  # the running one, offered, not used
        assert await LimitsStore(redis, redis_prefix).get("default") is None

        # Pointed at one from elsewhere, a change lands in one's Redis.
        changed = await cli(
            ["limits", "set", "--default", '{"cap": 7}', "--stack", str(one)], elsewhere
        )
        assert changed.returncode == 0, changed.stderr
        assert changed.stderr.startswith(f"target: the stack of {one} (--stack)")
        assert await LimitsStore(redis, redis_prefix).get("default") == {"cap": 7}

        assert await asyncio.to_thread(stack.interrupt) == 0
    # One stopped too: named from elsewhere, it is reported as stopped.
    gone = await asyncio.to_thread(_cli, ["status", "--stack", str(one)], cwd=elsewhere, env=env)
    assert gone.returncode == 4
    assert f"no stack running for {one}; start it with ./scripts/up" in gone.stderr


def test_tiers_never_reads_another_checkouts_stack(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The user's copy names another checkout's running stack: ``tiers`` run
    outside it does not take that stack's tiers for its own."""
    from turnstile_cli.cli import run

    state.publish(
        {
            "pid": os.getpid(),
            "runner": state.process_record(os.getpid()),
            "state_dir": str(tmp_path / "other" / ".run" / "direct"),
            "tiers": "gpu",
            "default_tier": "gpu",
        }
    )
    for variable in ("TURNSTILE_TIERS", "TURNSTILE_DEFAULT_TIER", "TURNSTILE_STACK_FILE"):
        monkeypatch.delenv(variable, raising=False)
    monkeypatch.chdir(tmp_path)
    run(["tiers", "--json"])
    answer = json.loads(capsys.readouterr().out)
    assert "gpu" not in json.dumps(answer)
    assert "no running local stack" in answer["source"]
