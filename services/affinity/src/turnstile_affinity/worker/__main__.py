"""``turnstile-worker``: keep this sandbox's presence at the relay until SIGTERM/SIGINT.

Exits 0 after a Goodbye on SIGTERM/SIGINT (or on SIGTERM while it still waits for
its sandbox id); 2 when the settings are invalid, the pod labels name an invalid
sandbox id, or the relay refuses the Hello as invalid (retrying would not help).
"""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import uvloop
from pydantic import ValidationError

from turnstile_affinity.worker.agent import HelloRefusedError, WorkerAgent
from turnstile_affinity.worker.podlabels import SandboxIdError
from turnstile_affinity.worker.settings import WorkerSettings
from turnstile_platform.logs import configure_logging

log = logging.getLogger("turnstile_affinity.worker")


async def _run(settings: WorkerSettings) -> int:
    agent = WorkerAgent(settings)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, agent.stop.set)
    try:
        await agent.run()
    except HelloRefusedError as refused:
        log.error("the relay refused this worker's Hello", extra={"detail": str(refused)})
        return 2
    except SandboxIdError as invalid:
        log.error("the pod labels name an invalid sandbox id", extra={"detail": str(invalid)})
        return 2
    return 0


def main() -> None:
    try:
        settings = WorkerSettings()
    except ValidationError as error:
        print(f"turnstile-worker: invalid settings:\n{error}", file=sys.stderr)
        sys.exit(2)
    configure_logging("turnstile-worker", level=settings.log_level, fmt=settings.log_format)
    sys.exit(uvloop.run(_run(settings)))


if __name__ == "__main__":
    main()
