"""The local stack: up on free ports, SERVING, and nothing left after Ctrl-C."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from functools import partial
from pathlib import Path

import pytest

from turnstile_cli.stack import procs, state
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_testing.stack import RunningStack, run_stack


async def _activate(stack: RunningStack, sandbox_id: str) -> substrate_pb2.ActivateResponse:
    async with stack.channel(stack.addresses[1]) as channel:
        stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
        response: substrate_pb2.ActivateResponse = await stub.Activate(
            substrate_pb2.ActivateRequest(
                sandbox_id=sandbox_id,
                client=common_pb2.ActivationClient(client_id="acme"),
                tier="container",
            ),
            timeout=20,
        )
        return response


def _tree(stack: RunningStack) -> list[procs.Proc]:
    return procs.descendants(stack.proc.pid)


async def _wait_gone(left: list[procs.Proc], timeout_s: float = 10.0) -> list[procs.Proc]:
    for _ in range(int(timeout_s / 0.05)):
        alive = [p for p in left if procs.alive(p)]
        if not alive:
            return []
        await asyncio.sleep(0.05)
    return [p for p in left if procs.alive(p)]


async def test_ctrl_c_stops_every_service_and_every_runtime_and_exits_zero(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        activated = await _activate(stack, "sb-stack-1")
        runtime_pid = int(activated.sandbox.runtime_name.removeprefix("proc-"))
        tree = _tree(stack)
        names = {p.command for p in tree}
        assert runtime_pid in {p.pid for p in tree}, names
        assert len(tree) >= 4, names  # three services and a runtime, at least

        code = await asyncio.to_thread(stack.interrupt)

        assert code == 0, stack.output()
        assert await _wait_gone(tree) == []
        output = stack.output()
        assert "Turnstile is up" in output
        assert "stopping 1 sandbox runtime(s)" in output


async def test_sigterm_stops_every_service_and_every_runtime(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        await _activate(stack, "sb-stack-term")
        tree = _tree(stack)

        stack.proc.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(stack.proc.wait, 60)

        assert code == 0, stack.output()
        assert await _wait_gone(tree) == []
        assert "stopping 1 sandbox runtime(s)" in stack.output()
        assert not (tmp_path / "stack.json").exists()


async def test_ctrl_c_through_tee_stops_everything_and_tells_the_stop_in_a_log(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    """``./scripts/up | tee up.log`` and Ctrl-C: tee dies first, so every line the
    stop writes finds its reader gone; the stop must go on regardless."""
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        through_tee=True,
    ) as stack:
        await stack.wait_serving()
        await _activate(stack, "sb-stack-tee")
        tree = _tree(stack)

        code = await asyncio.to_thread(stack.ctrl_c_through_tee)

        assert code == 0, stack.output()
        assert await _wait_gone(tree) == []
        told = (tmp_path / "stop.log").read_text()
        assert "stopping 1 sandbox runtime(s)" in told
        assert "stopped" in told
        assert not (tmp_path / "stack.json").exists()


async def test_ctrl_c_through_tee_in_a_terminal_tells_the_stop_on_the_terminal(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    """``turnstilectl up 2>&1 | tee log`` in a terminal, and Ctrl-C: tee dies with
    the same SIGINT, yet the person at the terminal sees how the stop went, not
    just ``^C`` and a prompt (and stop.log still has all of it)."""
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        tee_in_terminal=True,
    ) as stack:
        await stack.wait_serving()
        await _activate(stack, "sb-stack-tty")
        tree = _tree(stack)
        shown = len(stack.output())

        await asyncio.to_thread(stack.ctrl_c_in_terminal)

        assert await _wait_gone(tree) == []
        after_ctrl_c = stack.output()[shown:]
        assert "turnstile stack: stopping 1 sandbox runtime(s)" in after_ctrl_c
        assert "turnstile stack: stopped" in after_ctrl_c
        assert "stop.log" in after_ctrl_c
        assert "stopped" in (tmp_path / "stop.log").read_text()
        assert not (tmp_path / "stack.json").exists()


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


def _guard(stack: RunningStack) -> procs.Proc:
    return next(
        p
        for p in procs.all_processes()
        if p.ppid == stack.proc.pid and "turnstile_cli.stack.guard" in _cmdline(p.pid)
    )


async def _launched_runtime(stack: RunningStack, sandbox_id: str) -> procs.Proc:
    """A runtime started through the preloaded launcher (the local stack's default)."""
    activated = await _activate(stack, sandbox_id)
    runtime = procs.read(int(activated.sandbox.runtime_name.removeprefix("proc-")))
    assert runtime is not None
    assert "turnstile_substrate.direct.launcher" in _cmdline(runtime.ppid), _cmdline(runtime.ppid)
    return runtime


async def test_a_killed_runners_runtimes_and_services_are_stopped_by_its_guard(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        runtime = await _launched_runtime(stack, "sb-stack-guard")
        guard = _guard(stack)
        tree = [p for p in _tree(stack) if p.pid != guard.pid]

        stack.proc.kill()  # SIGKILL: the runner stops nothing itself
        stack.proc.wait(10)

        assert await _wait_gone([*tree, guard], timeout_s=30) == [], stack.output()
        assert runtime in tree
        told = (tmp_path / "stop.log").read_text()
        assert f"runner (pid {stack.proc.pid}) is gone" in told
        assert f"runtime of sb-stack-guard[{runtime.pid}]" in told
        assert not (tmp_path / "stack.json").exists()


async def test_a_killed_up_script_takes_its_stack_down_cleanly(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    """``./scripts/up`` killed outright: the runner it started in its background
    gets SIGTERM and stops everything as on Ctrl-C (rather than running on where
    no Ctrl-C reaches it)."""
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        under_script=True,
    ) as script:
        await script.wait_serving()
        (runner,) = [p for p in procs.descendants(script.proc.pid) if p.ppid == script.proc.pid]
        runtime = await _launched_runtime(script, "sb-stack-script")
        tree = procs.descendants(script.proc.pid)
        try:
            script.proc.kill()  # SIGKILL of the script's shell
            script.proc.wait(10)

            assert await _wait_gone(tree, timeout_s=45) == [], script.output()
        finally:
            procs.signal_proc(runner, signal.SIGKILL)
        assert runtime in tree
        assert "stopping 1 sandbox runtime(s)" in script.output()
        assert not (tmp_path / "stack.json").exists()


async def test_the_trace_receiver_is_a_process_of_its_own_not_a_server_in_the_runner(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    """The runner forks every service; a gRPC server in it would be in each fork,
    where gRPC's fork handlers abort the child before its exec (services died at
    start with SIGABRT). So the OTLP receiver runs apart, and dies with the runner."""
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        receivers = [
            p
            for p in procs.all_processes()
            if p.ppid == stack.proc.pid and "turnstile_cli.stack.otlp_receiver" in _cmdline(p.pid)
        ]
        assert len(receivers) == 1
        stack.proc.kill()
        stack.proc.wait(10)
        assert await _wait_gone(receivers) == []


async def test_the_next_up_stops_what_a_killed_runner_left_and_says_so(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    """The runner and its guard both killed (``kill -9`` of both, the OOM killer):
    the next ``up`` finds what is left by its recorded pids."""
    up = partial(
        run_stack,
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
    )
    with up() as stack:
        await stack.wait_serving()
        runtime = await _launched_runtime(stack, "sb-stack-kill")
        guard = _guard(stack)
        services = [p for p in _tree(stack) if p.ppid == stack.proc.pid and p.pid != guard.pid]

        os.kill(guard.pid, signal.SIGKILL)
        stack.proc.kill()
        stack.proc.wait(10)

        # The services die with their parent; the runtime outlives it by design.
        assert await _wait_gone(services) == []
        assert procs.alive(runtime)
        assert (tmp_path / "stack.json").exists()

    (tmp_path / "stack.log").unlink()
    with up() as stack:
        await stack.wait_serving()
        assert "did not stop cleanly" in stack.output()
        assert f"runtime of sb-stack-kill[{runtime.pid}]" in stack.output()
        assert not procs.alive(runtime)
        assert stack.interrupt() == 0


async def test_up_refuses_to_start_beside_a_running_stack_on_the_same_state(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    up = partial(
        run_stack,
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
    )
    with up() as first:
        await first.wait_serving()
        # The same state directory (and so the same stack.json) as the first.
        with up() as second:
            code = await asyncio.to_thread(second.proc.wait, 60)
            assert code != 0
            assert "a stack already runs" in second.output()
        assert first.proc.poll() is None


async def test_sighup_stops_the_stack_as_ctrl_c_does_and_logs_where_it_can(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        described = json.loads((tmp_path / "stack.json").read_text())
        assert described["tiers"] == "container,microvm"
        await _activate(stack, "sb-stack-hup")
        tree = _tree(stack)

        stack.proc.send_signal(signal.SIGHUP)  # the terminal closed
        code = await asyncio.to_thread(stack.proc.wait, 60)

        assert code == 0, stack.output()
        assert await _wait_gone(tree) == []
        # Nobody reads the terminal any more: the stop is told in stop.log.
        told = (tmp_path / "stop.log").read_text()
        assert "SIGHUP" in told
        assert "stopping 1 sandbox runtime(s)" in told
        assert not (tmp_path / "stack.json").exists()


async def test_closing_the_terminal_stops_the_stack_and_tells_the_stop_in_a_log(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    """A real terminal closed under the runner: the kernel's hang-up (not a signal
    sent by hand) and a terminal that fails every later write."""
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        through_terminal=True,
    ) as stack:
        await stack.wait_serving()
        runtime = await _launched_runtime(stack, "sb-stack-window")
        tree = _tree(stack)

        stack.close_terminal()
        code = await asyncio.to_thread(stack.proc.wait, 60)

        assert code == 0, stack.output()
        assert runtime in tree
        assert await _wait_gone(tree) == []
        told = (tmp_path / "stop.log").read_text()
        assert "SIGHUP" in told
        assert "stopping 1 sandbox runtime(s)" in told
        assert not (tmp_path / "stack.json").exists()


def test_stopped_sandboxes_old_directories_are_pruned_and_running_ones_kept(
    tmp_path: Path,
) -> None:
    old, recent, running = (tmp_path / name for name in ("sb-old", "sb-recent", "sb-running"))
    for directory in (old, recent, running):
        (directory / "workspace").mkdir(parents=True)
    (running / "runtime.json").write_text("{}")
    day_ago = time.time() - 2 * 86400
    for directory in (old, running):
        os.utime(directory, (day_ago, day_ago))

    pruned = state.prune(tmp_path, older_than_s=86400)

    assert pruned == ["sb-old"]
    assert not old.exists()
    assert recent.exists()
    assert running.exists()


@pytest.mark.slow  # about 15 s: the stack stops a dead substrate's orphans
async def test_a_runtime_orphaned_by_a_killed_substrate_is_stopped_with_the_stack(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        activated = await _activate(stack, "sb-stack-2")
        runtime_pid = int(activated.sandbox.runtime_name.removeprefix("proc-"))
        substrate = next(
            p
            for p in procs.descendants(stack.proc.pid)
            if p.ppid == stack.proc.pid
            and any(c.pid == runtime_pid for c in procs.descendants(p.pid))
        )
        runtime = procs.read(runtime_pid)
        assert runtime is not None
        # The runtime is in a session of its own: killing the substrate's group
        # leaves it running, re-parented to the stack runner (a subreaper).
        os.killpg(substrate.pid, signal.SIGKILL)

        code = await asyncio.to_thread(stack.proc.wait, 60)

        assert code == 1, stack.output()
        assert "substrate exited unexpectedly" in stack.output()
        assert await _wait_gone([runtime]) == [], stack.output()


@pytest.mark.parametrize("ports", ["1,2", "a,b,c", "1,2,70000"])
def test_up_refuses_ports_that_are_not_three_ports(ports: str) -> None:
    from turnstile_cli.cli import run

    with pytest.raises(SystemExit) as raised:
        run(["up", "--grpc-ports", ports])
    assert raised.value.code == 2
