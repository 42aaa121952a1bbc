"""The worker's sandbox credential, read from the file the substrate keeps current.

The substrate mints a credential for each runtime it starts and renews it while
the runtime lives (SPEC Z3): the Direct substrate writes it to a file in the
sandbox's directory (mode 0600) and names it in
``TURNSTILE_WORKER_CREDENTIAL_FILE``. The file is replaced atomically (a
rename), so a read sees the old credential or the new one. The agent reads it
before each Hello and at each heartbeat; a changed credential is presented on
the live stream as a ``CredentialRenewal``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from pathlib import Path

log = logging.getLogger(__name__)


def read_credential(path: Path) -> str | None:
    """The credential in ``path``; None while the file is missing or empty."""
    try:
        text = path.read_text(encoding="ascii").strip()
    except (FileNotFoundError, UnicodeDecodeError):
        return None
    return text or None


async def wait_for_credential(path: Path, interval_s: float, stop: asyncio.Event) -> str | None:
    """Poll ``path`` every ``interval_s`` until it holds a credential; None if stopped first."""
    logged = False
    while not stop.is_set():
        credential = read_credential(path)
        if credential is not None:
            return credential
        if not logged:
            logged = True
            log.info("waiting for the sandbox credential file", extra={"path": str(path)})
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=interval_s)
    return None
