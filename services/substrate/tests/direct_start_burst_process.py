"""A serving gRPC process that starts a burst of Direct runtimes right after start-up,
for ``test_substrate_direct_start_burst.py``.

It is what a substrate replica is when its first activations arrive: a grpc.aio
server with calls in flight (gRPC's threads and pollers running, its fork
handlers registered), and a Direct substrate, configured by ``TURNSTILE_*``
variables as the service reads them, that has just started. With
``--abort-in-fork-child`` it also registers a fork handler that aborts in the
child, as gRPC's did ("Check failed: next_worker->initialized_cv"), but every
time instead of sometimes: a runtime whose start runs fork handlers then fails
on every try, so the test is deterministic. Started with ``vfork()`` or
``posix_spawn()``, or forked from the launcher (a process of its own), a runtime
runs no handler of this process.

Argument: how many runtimes to start at once. On stdout: one JSON line,
``{"started": [...], "failed": {sandbox: error}}``; then it stops them all.
"""

from __future__ import annotations

import asyncio
import ctypes
import json
import sys

from grpc import aio
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer

from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.runtime import RuntimeSpec
from turnstile_substrate.settings import SubstrateSettings


async def no_gate() -> None:
    return None


def abort_in_fork_children() -> None:
    """Register ``abort()`` as a child fork handler of this process (glibc's
    ``__register_atfork``, what ``pthread_atfork`` calls; ``dso_handle`` NULL)."""
    libc = ctypes.CDLL(None)
    abort = ctypes.cast(libc.abort, ctypes.c_void_p)
    assert libc.__register_atfork(None, None, abort, None) == 0


async def main(count: int) -> int:
    if "--abort-in-fork-child" in sys.argv:
        abort_in_fork_children()
    server = aio.server()
    health_pb2_grpc.add_HealthServicer_to_server(HealthServicer(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    channel = aio.insecure_channel(f"127.0.0.1:{port}")
    stub = health_pb2_grpc.HealthStub(channel)

    async def call_forever() -> None:
        while True:
            await stub.Check(health_pb2.HealthCheckRequest())

    callers = [asyncio.create_task(call_forever()) for _ in range(4)]
    substrate = DirectSubstrate(SubstrateSettings())
    await substrate.start()
    ids = [f"sb-burst-{n}" for n in range(count)]
    started: list[str] = []
    failed: dict[str, str] = {}
    try:
        results = await asyncio.gather(
            *(
                substrate.ensure_runtime(
                    spec := RuntimeSpec(sandbox_id=sandbox_id, tier="", client_label="acme"),
                    substrate.plan(spec),
                    no_gate,
                )
                for sandbox_id in ids
            ),
            return_exceptions=True,
        )
        for sandbox_id, result in zip(ids, results, strict=True):
            if isinstance(result, BaseException):
                failed[sandbox_id] = repr(result)
            elif await substrate.find_running(sandbox_id) is not None:
                started.append(sandbox_id)
            else:
                failed[sandbox_id] = "started, then not running"
        print(json.dumps({"started": started, "failed": failed}), flush=True)
    finally:
        for sandbox_id in ids:
            await substrate.stop_runtime(sandbox_id)
        await substrate.close()
        for caller in callers:
            caller.cancel()
        await asyncio.gather(*callers, return_exceptions=True)
        await channel.close(None)
        await server.stop(None)
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main(int(sys.argv[1]))))
