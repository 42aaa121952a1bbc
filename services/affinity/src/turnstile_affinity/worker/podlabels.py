"""The sandbox id of a pod's worker, read from the pod's own labels (downward API).

A warm-pool pod starts before any sandbox is assigned to it, and a container's
environment is fixed at start. The substrate adopts the pod by patching its
labels, so the worker learns its sandbox id from a downward-API volume holding
``metadata.labels``: the kubelet rewrites that file when the labels change.

The file holds one ``key="value"`` line per label, sorted by key, values quoted
the way Go's ``%q`` quotes them. The kubelet swaps the whole volume in one
rename (a ``..data`` symlink), so a read never sees half a file. The file is
small and on a tmpfs, so it is read directly rather than from a thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from pathlib import Path

from turnstile_clientkeys import is_label_value

log = logging.getLogger(__name__)

#: The pod label naming the sandbox a pod runs (set at create, or by adoption).
SANDBOX_ID_LABEL = "turnstile.dev/sandbox-id"

_LINE = re.compile(r'^(?P<key>[^=\s]+)=(?P<value>".*")$')


class SandboxIdError(ValueError):
    """The labels name a sandbox id that is not a label value (never from a real pod)."""


def parse_labels(text: str) -> dict[str, str]:
    """The labels of a downward-API ``metadata.labels`` file.

    Lines that do not parse are skipped: label values are restricted to
    ``[A-Za-z0-9._-]``, so Kubernetes never writes one that needs an escape
    this reader does not know.
    """
    labels: dict[str, str] = {}
    for line in text.splitlines():
        match = _LINE.match(line.strip())
        if match is None:
            continue
        try:
            value = json.loads(match["value"])
        except ValueError:
            continue
        if isinstance(value, str):
            labels[match["key"]] = value
    return labels


def read_sandbox_id(path: Path) -> str | None:
    """The sandbox-id label in the labels file, or None while there is none.

    A missing file also reads as None: the volume may not be mounted yet.
    Raises :class:`SandboxIdError` for a value that is not a label value.
    """
    return _look(path)[1]


def _look(path: Path) -> tuple[bool, str | None]:
    """(whether the file exists, the sandbox id it names)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return False, None
    sandbox_id = parse_labels(text).get(SANDBOX_ID_LABEL)
    if not sandbox_id:
        return True, None
    if not is_label_value(sandbox_id):
        raise SandboxIdError(f"{SANDBOX_ID_LABEL}={sandbox_id!r} in {path} is not a label value")
    return True, sandbox_id


async def wait_for_sandbox_id(
    path: Path, interval_s: float, stop: asyncio.Event, waiting: asyncio.Event | None = None
) -> str | None:
    """Poll ``path`` every ``interval_s`` until it names a sandbox; None if ``stop`` is set first.

    ``waiting`` (when given) is set after the first read that found no sandbox
    id, so callers and tests can tell the worker is idle, not attached.
    """
    first, logged_missing = True, False
    while not stop.is_set():
        exists, sandbox_id = _look(path)
        if sandbox_id is not None:
            log.info("read the sandbox id from the pod labels", extra={"sandbox_id": sandbox_id})
            return sandbox_id
        if first:
            first = False
            log.info("waiting for the sandbox id label", extra={"path": str(path)})
            if waiting is not None:
                waiting.set()
        if not logged_missing and not exists:
            logged_missing = True
            log.warning("the pod labels file does not exist (yet)", extra={"path": str(path)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
    return None
