"""Process-tree housekeeping for the local stack, from ``/proc`` (Linux).

Each service runs in its own session and process group, so a signal reaches
everything it started in that group. The Direct substrate starts each sandbox's
runtime in a session of its own, on purpose: runtimes outlive a substrate
restart and are adopted again. So a process group is not enough to stop
everything. The stack runner therefore makes itself a *child subreaper*: a
runtime whose substrate died is re-parented to the runner instead of init, and
:func:`descendants` still finds it when the stack stops.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from dataclasses import dataclass
from pathlib import Path

_PR_SET_CHILD_SUBREAPER = 36
_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class Proc:
    """A process, identified by pid *and* start time (a pid may be reused)."""

    pid: int
    ppid: int
    start_ticks: int
    command: str


def read(pid: int) -> Proc | None:
    """The process ``pid``, or None when gone or a zombie."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_bytes()
    except OSError:
        return None
    close = raw.rfind(b")")
    command = raw[raw.find(b"(") + 1 : close].decode(errors="replace")
    fields = raw[close + 2 :].split()
    if fields[0] in (b"Z", b"X"):
        return None
    return Proc(pid=pid, ppid=int(fields[1]), start_ticks=int(fields[19]), command=command)


def all_processes() -> list[Proc]:
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (proc := read(int(entry))) is not None:
            found.append(proc)
    return found


def descendants(root: int) -> list[Proc]:
    """Every live process below ``root`` in the parent tree, children first."""
    children: dict[int, list[Proc]] = {}
    for proc in all_processes():
        children.setdefault(proc.ppid, []).append(proc)
    found: list[Proc] = []
    frontier = [root]
    while frontier:
        pid = frontier.pop()
        for child in children.get(pid, []):
            found.append(child)
            frontier.append(child.pid)
    return found


def alive(proc: Proc) -> bool:
    """Whether ``proc`` still runs (same pid, same start time, not a zombie)."""
    current = read(proc.pid)
    return current is not None and current.start_ticks == proc.start_ticks


def signal_proc(proc: Proc, sig: signal.Signals) -> None:
    if alive(proc):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(proc.pid, sig)


def signal_group_of(proc: Proc, sig: signal.Signals) -> None:
    """Signal ``proc``'s whole process group when it leads one (a service, a
    runtime: each starts a session of its own), else ``proc`` alone."""
    if not alive(proc):
        return
    with contextlib.suppress(ProcessLookupError, PermissionError):
        if os.getpgid(proc.pid) == proc.pid:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)


def die_with_parent() -> None:  # pragma: no cover - runs in the child before exec
    """Get SIGTERM when the parent dies: a child of the runner when the runner is
    killed; the runner itself when the script that started it is."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux ≥ 3.4); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return bool(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0)
    except (OSError, AttributeError):
        return False


def reap_orphans() -> None:
    """Collect exit statuses of adopted orphans (they are our children now)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
