"""Who the local stack's sandbox runtimes run as (SPEC O4).

A Direct substrate running as root refuses to start unless told which uid its
runtimes run as (they run untrusted code). The stack picks for it:

- not root: nothing to pick (a process cannot change its uid); runtimes run as
  you, with an allowlisted environment only;
- root: a uid per runtime from :data:`RUNTIME_UIDS` (no ``/etc/passwd`` entries
  are needed), after checking that such a uid can run the worker agent at all:
  import it with this interpreter, and reach the state directory. A root-only
  interpreter (under ``/root``, say) or a state directory under a private home
  fails the check; the stack then says why and runs runtimes as root, as before
  (a development stack on your own machine, said out loud, not a silent default);
- ``TURNSTILE_DIRECT_RUNTIME_UIDS`` or ``TURNSTILE_DIRECT_RUNTIME_USER`` set in
  your environment: yours wins, unchecked.

When it falls back to root, the note says how to fix it (:func:`fix`): move a
checkout other users cannot reach, or rebuild the workspace on an interpreter they
can run — one found on this machine (Debian's ``python3``), else uv's managed
Python installed to a readable place (``UV_PYTHON_INSTALL_DIR``).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

#: The uids the stack's runtimes run as when it runs as root (one per runtime).
RUNTIME_UIDS = "2600000-2600999"

_SETTINGS = ("TURNSTILE_DIRECT_RUNTIME_UIDS", "TURNSTILE_DIRECT_RUNTIME_USER")

#: What a runtime of another uid must manage: import the worker agent.
_PROBE = "import turnstile_affinity.worker.__main__"


def unreachable_parent(directory: Path) -> Path | None:
    """The first parent of ``directory`` other users cannot search (o+x), or None.
    Parents not made yet are not checked (the substrate creates them 0755 by umask)."""
    for parent in directory.absolute().parents:
        try:
            mode = parent.stat().st_mode
        except FileNotFoundError:
            continue
        if not mode & 0o001:
            return parent
    return None


def probe(uid: int, timeout_s: float = 60.0) -> str | None:
    """Why a process of ``uid`` cannot run the worker agent, or None when it can."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PROBE],
            user=uid,
            group=uid,
            extra_groups=[],
            cwd="/",
            env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
            capture_output=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.SubprocessError) as error:
        return f"uid {uid} cannot run {sys.executable}: {error}"
    if done.returncode != 0:
        last = (done.stderr.decode(errors="replace").strip().splitlines() or ["?"])[-1]
        return f"uid {uid} cannot import the worker agent with {sys.executable}: {last}"
    return None


#: Interpreters looked for when the workspace's is root's alone (a pyenv under /root).
INTERPRETERS = ("/usr/bin/python3", "/usr/local/bin/python3")

#: The workspace's Python (pyproject's requires-python).
MIN_PYTHON = (3, 11)

#: Where the note suggests installing uv's managed Python, readable by every user.
READABLE_PYTHON_DIR = "/opt/uv-python"


def runnable_interpreter(uid: int, candidates: tuple[str, ...] = INTERPRETERS) -> str | None:
    """The first of ``candidates`` a process of ``uid`` can run, new enough for the
    workspace, or None."""
    check = f"import sys; sys.exit(sys.version_info[:2] < {MIN_PYTHON!r})"
    for candidate in candidates:
        if not os.access(candidate, os.X_OK):
            continue
        try:
            done = subprocess.run(
                [candidate, "-c", check],
                user=uid,
                group=uid,
                extra_groups=[],
                cwd="/",
                env={"PATH": "/usr/bin:/bin"},
                capture_output=True,
                timeout=30,
                check=False,
            )
        except (OSError, subprocess.SubprocessError):
            continue
        if done.returncode == 0:
            return candidate
    return None


def fix(state_dir: Path, uid: int) -> str:
    """How to let runtimes of ``uid`` run: what to move, or which interpreter to
    rebuild the workspace on (once: uv recreates ``.venv`` for another interpreter)."""
    for what, path in (("the state directory", state_dir), ("the workspace", Path(sys.prefix))):
        hidden = unreachable_parent(path)
        if hidden is not None:
            return (
                f"{what} is under {hidden}, which other users cannot search: use a checkout "
                "(or --state-dir) outside it, e.g. under /srv or /opt"
            )
    found = runnable_interpreter(uid)
    if found is not None:
        return (
            f"rebuild the workspace on {found}, which other users can run: "
            f"UV_PYTHON={found} ./scripts/up"
        )
    return (
        f"install uv's managed Python where other users can run it, then rebuild the "
        f"workspace on it: UV_PYTHON_INSTALL_DIR={READABLE_PYTHON_DIR} uv python install 3.11 && "
        f'UV_PYTHON="$(UV_PYTHON_INSTALL_DIR={READABLE_PYTHON_DIR} uv python find '
        '--managed-python 3.11)" ./scripts/up'
    )


def runtime_user_env(
    state_dir: Path, environ: Mapping[str, str] = os.environ
) -> tuple[dict[str, str], str | None]:
    """The substrate's runtime-user settings, and a note for the operator (None: nothing
    to say). Blocking (runs the probe)."""
    if any(environ.get(name) for name in _SETTINGS) or os.geteuid() != 0:
        return {}, None
    first = int(RUNTIME_UIDS.split("-")[0])
    hidden = unreachable_parent(state_dir)
    reason = f"{hidden} is not searchable by other users" if hidden is not None else probe(first)
    if reason is None:
        return {"TURNSTILE_DIRECT_RUNTIME_UIDS": RUNTIME_UIDS}, (
            f"sandbox runtimes run as uids {RUNTIME_UIDS}, one each"
        )
    return {"TURNSTILE_DIRECT_RUNTIME_USER": "root"}, (
        f"sandbox runtimes run as ROOT: {reason}. To run each as a uid of its own, "
        f"{fix(state_dir, first)} (docs/substrate.md#the-local-stack-as-root)"
    )
