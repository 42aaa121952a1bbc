"""The CLI finds its checkout's running stack (``.run/stack.json``): addresses,
plaintext or mTLS with its certificate, Redis URL and prefix, with nothing set by
hand; and the stack's Redis prefix is its checkout's own, and so are its database
and (when not given) its ports. Choosing between checkouts: test_cli_targets.py."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import replace
from pathlib import Path

import pytest

from turnstile_cli.cli import run
from turnstile_cli.context import Context, LocalStack, Targets
from turnstile_cli.output import Output
from turnstile_cli.stack import state
from turnstile_cli.stack.command import config_from_args
from turnstile_cli.stack.config import StackConfig, checkout_prefix
from turnstile_cli.stack.preflight import PreflightError, check_ports, settle_ports
from turnstile_cli.target import running_stacks
from turnstile_platform.server import GrpcService
from turnstile_testing.probe import settings
from turnstile_testing.processes import free_port
from turnstile_testing.stack import run_stack


def _bare_env(state_home: Path) -> dict[str, str]:
    """A new terminal's environment: no TURNSTILE_* variable at all."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
    return {**env, "XDG_STATE_HOME": str(state_home), "COLUMNS": "200"}


def _cli(argv: list[str], *, cwd: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "turnstile_cli", *argv],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
async def plaintext_server() -> AsyncIterator[str]:
    app = GrpcService("probe", settings(plaintext=True), service_names=[])
    await app.start()
    try:
        yield app.address
    finally:
        await app.stop()


def _describe(path: Path, *, address: str, transport: dict[str, object], pid: int) -> None:
    state.write(
        path,
        {
            "pid": pid,
            "runner": state.process_record(pid),
            "addresses": {"admission": address, "substrate": address, "affinity": address},
            "transport": transport,
            "redis_url": "redis://127.0.0.1:6379/9",
            "redis_prefix": "turnstile:abcd1234:",
        },
    )


async def test_a_plaintext_stack_is_talked_to_in_plaintext_without_being_told(
    plaintext_server: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``./scripts/up --plaintext``: no TURNSTILE_PLAINTEXT, and certificates of an
    earlier mTLS start lying in ``.run/tls`` of the working directory."""
    monkeypatch.delenv("TURNSTILE_PLAINTEXT", raising=False)
    for service in ("ADMISSION", "SUBSTRATE", "AFFINITY"):
        monkeypatch.delenv(f"TURNSTILE_{service}_ADDR", raising=False)
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".run" / "tls").mkdir(parents=True)
    (tmp_path / ".run" / "tls" / "cli.crt").write_text("stale")
    _describe(
        tmp_path / ".run" / "stack.json",
        address=plaintext_server,
        transport={"mode": "plaintext"},
        pid=os.getpid(),
    )
    code = await asyncio.to_thread(run, ["--json", "status"])
    health = json.loads(capsys.readouterr().out)
    assert code == 0
    assert health["admission"] == {"address": plaintext_server, "health": "SERVING"}


def test_flags_and_variables_still_win_over_the_stack_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _describe(
        state.user_file(), address="127.0.0.1:1", transport={"mode": "plaintext"}, pid=os.getpid()
    )
    monkeypatch.setenv("TURNSTILE_REDIS_PREFIX", "mine:")
    stack = LocalStack.read(state.user_file())
    assert stack is not None
    assert stack.plaintext
    monkeypatch.delenv("TURNSTILE_ADMISSION_ADDR", raising=False)
    monkeypatch.setenv("TURNSTILE_SUBSTRATE_ADDR", "127.0.0.1:2")
    targets = Targets.resolve(affinity="127.0.0.1:3", stack=stack)
    assert (targets.admission, targets.substrate, targets.affinity) == (
        "127.0.0.1:1",
        "127.0.0.1:2",
        "127.0.0.1:3",
    )
    ctx = Context(out=Output(), targets=targets, stack=stack)
    monkeypatch.delenv("TURNSTILE_REDIS_URL", raising=False)
    assert ctx.redis_target(None, None) == ("redis://127.0.0.1:6379/9", "mine:")
    assert ctx.redis_target("redis://x:1/0", "flag:") == ("redis://x:1/0", "flag:")


def test_a_stack_file_whose_runner_is_gone_describes_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A runner killed outright leaves its file behind: its addresses and
    certificates describe nothing (the next ``up`` removes it)."""
    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        check=True,
        capture_output=True,
        text=True,
    )
    dead = int(done.stdout)
    path = state.user_file()
    path.parent.mkdir(parents=True)
    path.write_text(
        json.dumps(
            {
                "pid": dead,
                "runner": {"pid": dead, "start_ticks": 1, "command": "turnstilectl"},
                "addresses": {"admission": "127.0.0.1:1"},
                "transport": {"mode": "plaintext"},
            }
        )
    )
    monkeypatch.chdir(tmp_path)  # no .run/ in this directory or its parents
    monkeypatch.delenv("TURNSTILE_STACK_FILE", raising=False)
    assert state.find_running() is None
    assert state.find() is None  # nor do ``tiers`` take a dead stack's tiers from it
    assert LocalStack.read(path) is None
    assert running_stacks() == []


def test_each_checkout_has_its_own_redis_prefix(tmp_path: Path) -> None:
    one = checkout_prefix(tmp_path / "one" / ".run" / "direct")
    two = checkout_prefix(tmp_path / "two" / ".run" / "direct")
    assert one != two
    assert one == checkout_prefix(tmp_path / "one" / ".run" / "direct")
    assert re.fullmatch(r"turnstile:[0-9a-f]{8}:", one)


def test_up_without_a_prefix_takes_its_checkouts(monkeypatch: pytest.MonkeyPatch) -> None:
    from turnstile_cli.parser import build_parser

    monkeypatch.delenv("TURNSTILE_REDIS_PREFIX", raising=False)
    args = build_parser().parse_args(["up"])
    assert args.redis_prefix is None  # the command then takes checkout_prefix(state dir)


def _up_config(monkeypatch: pytest.MonkeyPatch, checkout: Path, *argv: str) -> StackConfig:
    from turnstile_cli.parser import build_parser

    for variable in (
        "TURNSTILE_REDIS_PREFIX",
        "TURNSTILE_DATABASE_URL",
        "TURNSTILE_DIRECT_STATE_DIR",
    ):
        monkeypatch.delenv(variable, raising=False)
    checkout.mkdir(parents=True, exist_ok=True)
    monkeypatch.chdir(checkout)
    return config_from_args(build_parser().parse_args(["up", *argv]))


def test_two_checkouts_stacks_share_neither_keys_nor_database(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    one = _up_config(monkeypatch, tmp_path / "one")
    two = _up_config(monkeypatch, tmp_path / "two")

    assert one.redis_prefix != two.redis_prefix
    assert one.database_url != two.database_url
    assert re.fullmatch(
        r"postgresql://postgres@127\.0\.0\.1:5432/turnstile_[0-9a-f]{8}", one.database_url
    )
    # The same checkout gets the same ones on every start (its data stays its own).
    assert _up_config(monkeypatch, tmp_path / "one") == one
    # Nothing given: every port may move when taken; given ones never do.
    assert one.pick_free == {"grpc", "metrics", "prometheus"}
    given = _up_config(
        monkeypatch, tmp_path / "one", "--grpc-ports", "1,2,3", "--database-url", "postgresql://h/x"
    )
    assert given.pick_free == {"metrics", "prometheus"}
    assert given.ports == (1, 2, 3)
    assert given.database_url == "postgresql://h/x"


def test_a_taken_default_port_is_not_reused_and_a_given_one_is_refused() -> None:
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    taken = holder.getsockname()[1]
    try:
        defaulted = StackConfig(
            ports=(taken, free_port(), free_port()),
            metrics_ports=(0, taken, 0),
            prometheus_port=taken,
            pick_free=frozenset({"grpc", "metrics", "prometheus"}),
        )

        settled, moved = settle_ports(defaulted)

        chosen = [*settled.ports, *settled.metrics_ports, settled.prometheus_port]
        assert taken not in chosen
        assert settled.ports[1:] == defaulted.ports[1:]  # free ones stay
        assert settled.metrics_ports[0] == settled.metrics_ports[2] == 0  # off stays off
        assert len({p for p in chosen if p}) == len([p for p in chosen if p])  # no two alike
        assert f"admission port {taken} is taken" in moved[0]
        check_ports(settled)  # every one free

        given = replace(defaulted, pick_free=frozenset())
        assert settle_ports(given) == (given, [])
        with pytest.raises(PreflightError, match=f"port {taken} is in use"):
            check_ports(given)
    finally:
        holder.close()


async def test_a_stack_given_no_ports_moves_off_a_taken_default_and_says_where(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    """A second checkout's ``./scripts/up`` while another stack holds :50051: it
    starts on a free port, says so, records it, and the CLI finds it there."""
    holder = socket.socket()
    try:
        holder.bind(("127.0.0.1", 50051))
        holder.listen()
    except OSError:  # another process holds it already: as good for this test
        holder.close()
    (tmp_path / ".run").mkdir()
    try:
        with run_stack(
            tmp_path / ".run",  # the checkout tmp_path's own stack
            redis_url=redis_url,
            redis_prefix=redis_prefix,
            database_url=database_url,
            pick_ports=True,
        ) as stack:
            await stack.wait_serving()
            assert stack.ports[0] != 50051
            assert f"admission port 50051 is taken: using {stack.ports[0]}" in stack.output()
            assert stack.state_home is not None
            status = await asyncio.to_thread(
                _cli, ["status", "--json"], cwd=tmp_path, env=_bare_env(stack.state_home)
            )
            assert status.returncode == 0, status.stdout + status.stderr
            assert json.loads(status.stdout)["admission"] == {
                "address": stack.addresses[0],
                "health": "SERVING",
            }
            assert stack.interrupt() == 0
    finally:
        holder.close()


async def test_a_real_plaintext_stack_after_an_mtls_start_needs_no_setting(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    """``./scripts/up --plaintext`` after a TLS start: the old certificates lie in
    ``.run/tls`` of the checkout, no TURNSTILE_PLAINTEXT is set, and ``status``
    from the checkout and from elsewhere (``--stack``) talks plaintext to it."""
    checkout = tmp_path / "checkout"
    (checkout / ".run" / "tls").mkdir(parents=True)
    for name in ("cli.crt", "cli.key", "ca.crt"):
        (checkout / ".run" / "tls" / name).write_text("left by an mTLS start")
    with run_stack(
        checkout / ".run",
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        plaintext=True,
    ) as stack:
        await stack.wait_serving()
        assert stack.state_home is not None
        env = _bare_env(stack.state_home)
        # In the checkout, and from elsewhere naming it.
        for where, named in ((checkout, []), (tmp_path, ["--stack", str(checkout)])):
            status = await asyncio.to_thread(_cli, ["--json", "status", *named], cwd=where, env=env)
            assert status.returncode == 0, status.stderr
            health = json.loads(status.stdout)
            assert health["admission"]["health"] == "SERVING"


def test_when_the_current_stack_stops_another_running_one_becomes_current(
    tmp_path: Path,
) -> None:
    """Two checkouts' stacks: the later is current; once it stops, the earlier,
    still running, is found again (not "no stack")."""
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        for pid, port in ((other.pid, 1), (os.getpid(), 2)):
            record = state.process_record(pid)
            assert record is not None
            state.publish(
                {
                    "pid": pid,
                    "runner": record,
                    "addresses": {"admission": f"127.0.0.1:{port}"},
                    "transport": {"mode": "plaintext"},
                }
            )
        assert (state.read(state.user_file()) or {}).get("pid") == os.getpid()
        state.retire(os.getpid())
        assert (state.read(state.user_file()) or {}).get("pid") == other.pid
        other.kill()
        other.wait()
        state.retire(other.pid)
        assert not state.user_file().exists()
        assert list(state.user_file().parent.glob("stacks/*.json")) == []
    finally:
        other.kill()
        other.wait()


def test_with_no_stack_running_keys_go_to_the_checkouts_prefix(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``keys allow`` before ``./scripts/up``: the prefix that stack will read."""
    (tmp_path / "checkout" / ".run").mkdir(parents=True)
    (tmp_path / "checkout" / "docs").mkdir()
    monkeypatch.chdir(tmp_path / "checkout" / "docs")
    monkeypatch.delenv("TURNSTILE_REDIS_PREFIX", raising=False)
    monkeypatch.delenv("TURNSTILE_STACK_FILE", raising=False)
    ctx = Context(out=Output())
    _, prefix = ctx.redis_target(None, None)
    assert prefix == checkout_prefix(tmp_path / "checkout" / ".run" / "direct")
    monkeypatch.chdir(tmp_path)
    assert ctx.redis_target(None, None)[1] == "turnstile:"
