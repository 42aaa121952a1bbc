"""``python -m turnstile_testing.probe_server``: the real bootstrap serving ``test.Probe``
in a process of its own, for tests that send it signals.

``Slow`` prints ``slow-started`` when it begins, then sleeps the seconds given as
its payload. The bound port is printed as ``port=N`` once serving.
"""

from __future__ import annotations

import asyncio
import sys
from typing import Any

import grpc.aio

from turnstile_platform.logs import configure_logging
from turnstile_platform.server import GrpcService
from turnstile_platform.settings import ServiceSettings
from turnstile_testing.probe import add_probe


async def _slow(payload: bytes, _: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    print("slow-started", flush=True)
    await asyncio.sleep(float(payload.decode() or "1"))
    return b"slow-done"


async def _main() -> None:
    settings = ServiceSettings(port=0)
    app = GrpcService("probe", settings, service_names=["test.Probe"])
    add_probe(app, {"Slow": _slow})
    loop = asyncio.get_running_loop()
    import signal

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, app.request_stop)
    port = await app.start()
    print(f"port={port}", flush=True)
    await app.wait()


if __name__ == "__main__":
    configure_logging("probe", fmt="text")
    asyncio.run(_main())
    sys.exit(0)
