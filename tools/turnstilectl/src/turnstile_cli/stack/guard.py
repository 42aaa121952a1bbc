"""The runner's guard: what a runner killed outright (SIGKILL, the OOM killer) left
running is stopped at once, not at the next ``up``.

A killed runner stops nothing itself. Its services get SIGTERM from the kernel
(``PR_SET_PDEATHSIG``) and exit, but the Direct substrate's runtimes do not die
with the substrate (they outlive its restarts by design, and a preloaded
launcher's forks are not even the substrate's children): left alone they would
run until the next ``up`` found them by their records.

So the runner starts this small process (``python -m turnstile_cli.stack.guard
RUNNER_PID STATE_DIR FD``) in a session of its own, out of reach of the
terminal's Ctrl-C and hang-up and of a signal to the runner's process group. It
holds the read end of a pipe whose only write end is the runner's, and blocks on
it: end of file means the runner is gone, however it went. A runner that stopped
cleanly has removed its ``stack.json`` by then and the guard just exits; if the
file is still there and names that runner, the guard stops every process it
records and every runtime the state directory's records name (the same list the
next ``up`` would stop, :func:`turnstile_cli.stack.state.leftovers`), removes the
file, and writes what it did to ``stop.log`` beside it. If the guard is killed
too, the next ``up`` still does the same and says so.

Only the standard library and the stack's ``/proc`` helpers: it costs the runner
nothing to start and holds nothing but its pipe while it waits.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from turnstile_cli.stack import procs, state

#: How long what is left gets after SIGTERM before SIGKILL.
GRACE_S = 5.0


def start(state_dir: Path) -> tuple[subprocess.Popen[bytes], int] | None:
    """Start the guard of this runner; its process and the pipe's write end, which
    the runner keeps open for as long as it lives (closing it stands the guard
    down: :func:`stand_down`). None when it could not be started."""
    read_end, write_end = os.pipe()
    try:
        guard = subprocess.Popen(
            [
                sys.executable,
                "-m",
                __name__,
                str(os.getpid()),
                str(state_dir.absolute()),
                str(read_end),
            ],
            pass_fds=(read_end,),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
    except OSError:
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    # Never inherited by what the runner starts: the guard sees EOF when the runner
    # itself is gone, not when the last of its children is.
    os.set_inheritable(write_end, False)
    return guard, write_end


def stand_down(guard: subprocess.Popen[bytes], write_end: int) -> None:
    """The runner stopped cleanly: close the pipe (the guard finds no ``stack.json``
    and exits) and reap the guard."""
    with contextlib.suppress(OSError):
        os.close(write_end)
    try:
        guard.wait(timeout=5)
    except subprocess.TimeoutExpired:
        guard.kill()
        guard.wait()


def watch(runner_pid: int, state_dir: Path, read_end: int) -> int:
    """Wait for the runner to be gone, then stop what it left (module docstring)."""
    for sig in (signal.SIGINT, signal.SIGHUP, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_IGN)
    with os.fdopen(read_end, "rb") as pipe:
        pipe.read()  # returns at end of file: the runner is gone
    path = state.path_for(state_dir)
    last = state.read(path)
    if last is None or last.get("pid") != runner_pid:
        return 0  # stopped cleanly, or the file is another runner's
    left = state.leftovers(last, state_dir)
    report = [f"the stack runner (pid {runner_pid}) is gone without stopping the stack"]
    if left:
        report.append(
            "its guard stops what it left: " + ", ".join(f"{p.command}[{p.pid}]" for p in left)
        )
        stop(left)
        # A runtime the dying substrate started meanwhile has a record now too.
        late = [p for p in state.leftovers(last, state_dir) if p not in left]
        if late:
            report.append("and " + ", ".join(f"{p.command}[{p.pid}]" for p in late))
            stop(late)
            left += late
        still = [p for p in left if procs.alive(p)]
        if still:
            report.append("still running: " + ", ".join(f"{p.command}[{p.pid}]" for p in still))
    report.append("stopped")
    path.unlink(missing_ok=True)
    with contextlib.suppress(OSError):
        state.retire(runner_pid)
    _tell(path.with_name("stop.log"), report)
    return 0


def stop(left: list[procs.Proc]) -> None:
    """SIGTERM each process's group, SIGKILL what is still there after the grace."""
    for proc in left:
        procs.signal_group_of(proc, signal.SIGTERM)
    deadline = time.monotonic() + GRACE_S
    while any(procs.alive(p) for p in left) and time.monotonic() < deadline:
        time.sleep(0.05)
    for proc in left:
        procs.signal_group_of(proc, signal.SIGKILL)


def _tell(log: Path, lines: list[str]) -> None:
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    with contextlib.suppress(OSError), log.open("a") as out:
        out.writelines(f"{stamp} guard  {line}\n" for line in lines)


if __name__ == "__main__":
    sys.exit(watch(int(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])))
