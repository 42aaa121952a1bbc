"""The running local stack's description, for commands run in another shell.

``turnstilectl up`` writes ``stack.json`` next to its state directory (``.run/``
by default) while it runs and removes it when it stops, and a copy for the user
(:func:`user_file`, ``$XDG_STATE_HOME/turnstile/stack.json``): the addresses, the
transport (plaintext or mTLS, and then the CLI's certificate files), the Redis URL
and prefix, the tiers (:func:`publish`, :func:`retire`). Every command reads it
(:func:`find_running`) for what neither a flag nor a ``TURNSTILE_*`` variable
says, so ``turnstilectl status`` works from ``~`` or ``docs/`` and knows a
``--plaintext`` stack without being told.

``TURNSTILE_STACK_FILE`` points elsewhere; without it the file is looked for in
``.run/`` of the working directory and of each of its parents, then the user's.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from turnstile_cli.stack import procs

FILE_NAME = "stack.json"
#: What a description's ``format`` says: readers ignore fields they do not know.
FORMAT = 1
#: Each Direct runtime's record in its sandbox's directory (pid and start time).
RUNTIME_RECORD = "runtime.json"


def process_record(pid: int) -> dict[str, Any] | None:
    """How ``stack.json`` names a process: pid *and* start time, so a later run
    never signals a process that merely reuses the pid."""
    proc = procs.read(pid)
    if proc is None:
        return None
    return {"pid": proc.pid, "start_ticks": proc.start_ticks, "command": proc.command}


def _recorded(entry: object) -> procs.Proc | None:
    if not isinstance(entry, dict):
        return None
    try:
        return procs.Proc(
            pid=int(entry["pid"]),
            ppid=0,
            start_ticks=int(entry["start_ticks"]),
            command=str(entry.get("command", "?")),
        )
    except (KeyError, TypeError, ValueError):
        return None


def recorded_runner(description: dict[str, Any]) -> procs.Proc | None:
    """The runner that wrote ``description``, when it recorded itself."""
    return _recorded(description.get("runner"))


def leftovers(description: dict[str, Any], state_dir: Path) -> list[procs.Proc]:
    """What a stack that did not stop left running: the processes its
    ``stack.json`` recorded (services, Prometheus) and the runtimes its Direct
    state directory records, those still alive."""
    found = [_recorded(e) for e in description.get("processes", [])]
    if state_dir.is_dir():
        for record in sorted(state_dir.glob(f"*/{RUNTIME_RECORD}")):
            try:
                entry = json.loads(record.read_text())
            except (OSError, ValueError):
                continue
            if isinstance(entry, dict):
                found.append(_recorded({**entry, "command": f"runtime of {record.parent.name}"}))
    return [p for p in found if p is not None and procs.alive(p)]


def read(path: Path) -> dict[str, Any] | None:
    """The description at ``path``, or None when there is none (or it is unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def path_for(state_dir: Path) -> Path:
    """Where a stack whose Direct state lives in ``state_dir`` describes itself."""
    return state_dir.absolute().parent / FILE_NAME


def user_file() -> Path:
    """The user's copy of the running stack's description, found from any directory:
    ``$XDG_STATE_HOME/turnstile/stack.json`` (default ``~/.local/state/…``)."""
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "turnstile" / FILE_NAME


def write(path: Path, description: dict[str, Any]) -> None:
    """Write ``description`` atomically, readable by its owner only (it names the
    Redis URL, which may hold a password)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(partial, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as file:
        file.write(json.dumps(description, indent=2, sort_keys=True) + "\n")
    partial.replace(path)


def publish(description: dict[str, Any]) -> None:
    """Make ``description`` the user's current stack (:func:`user_file`), and keep
    it among the running ones (``stacks/<pid>.json`` beside it): when another
    checkout's stack, started later, stops, this one becomes current again."""
    write(_registered(int(description["pid"])), description)
    write(user_file(), description)


def retire(pid: int) -> None:
    """The stack run by ``pid`` stopped (or died): drop its entry, and if it was
    the user's current stack, make the newest one still running current, or
    remove the file when none runs."""
    _registered(pid).unlink(missing_ok=True)
    current = read(user_file())
    if current is not None and current.get("pid") != pid:
        return  # another checkout's stack is current
    others = sorted(
        (e for e in user_file().parent.glob("stacks/*.json") if e.is_file()),
        key=lambda e: e.stat().st_mtime,
        reverse=True,
    )
    for entry in others:
        data = read(entry)
        if data is not None and _running(data):
            write(user_file(), data)
            return
        entry.unlink(missing_ok=True)  # left by a runner killed outright
    user_file().unlink(missing_ok=True)


def _registered(pid: int) -> Path:
    return user_file().parent / "stacks" / f"{pid}.json"


def _candidates() -> list[Path]:
    explicit = os.environ.get("TURNSTILE_STACK_FILE")
    if explicit:
        return [Path(explicit)]
    here = Path.cwd()
    return [*(d / ".run" / FILE_NAME for d in (here, *here.parents)), user_file()]


def find() -> tuple[Path, dict[str, Any]] | None:
    """The stack's file and description, or None when there is none. The user's
    copy counts only while its runner runs: it stands for no checkout of its own."""
    mine = user_file()
    for candidate in _candidates():
        data = read(candidate)
        if data is None:
            continue
        if candidate == mine and not _running(data):
            continue
        return candidate, data
    return None


def _running(description: dict[str, Any]) -> bool:
    runner = recorded_runner(description)
    return runner is not None and procs.alive(runner)


def find_running() -> tuple[Path, dict[str, Any]] | None:
    """Like :func:`find`, but only a description whose runner still runs: a stack
    killed outright leaves its file behind, and its addresses and certificates
    then describe nothing (the next ``up`` removes it)."""
    for candidate in _candidates():
        data = read(candidate)
        if data is not None and _running(data):
            return candidate, data
    return None


def prune(state_dir: Path, *, older_than_s: float, now: float | None = None) -> list[str]:
    """Remove the directories of stopped sandboxes left for longer than ``older_than_s``.

    The Direct substrate keeps a stopped sandbox's directory (its workspace is what
    a restore brings back, its log what a person reads), so without this the state
    directory gains one directory per sandbox ever created. A sandbox whose
    runtime record (``runtime.json``) is there may be running and is never
    touched; a stopped one's directory changed last when its record was dropped,
    so its mtime says how long it has been stopped. Returns the pruned ids.
    """
    import shutil
    import time

    if not state_dir.is_dir():
        return []
    cutoff = (time.time() if now is None else now) - older_than_s
    pruned: list[str] = []
    for child in sorted(state_dir.iterdir()):
        try:
            if not child.is_dir() or (child / "runtime.json").exists():
                continue
            if child.stat().st_mtime > cutoff:
                continue
        except OSError:
            continue
        shutil.rmtree(child, ignore_errors=True)
        pruned.append(child.name)
    return pruned
