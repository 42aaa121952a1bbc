"""Floods on one Attach stream (SPEC O6), with and without the stream's budgets.

    uv run python services/affinity/bench/bench_stream_floods.py [--seconds 5]

Against one private redis-server and one in-process affinity replica (attestation
enforced, heartbeat interval 5 s), twice: once with budgets so large they never
bind and refusal lines unthrottled (what the relay did before SPEC O6), and once
with the defaults. Each
run measures, over ``--seconds`` of one stream writing as fast as it can:

- heartbeats: acks/s at the client and Redis scripts/s at the server
  (``INFO commandstats``: EVAL + EVALSHA calls, nothing else uses this Redis);
- renewals: signature checks/s (calls of the relay's verifier) and acceptances/s;

and once: 2,000 Hellos with a forged credential, and how many log lines the
relay wrote for them.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import tempfile
import time
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import redis.asyncio as aioredis

from turnstile_affinity import attestation
from turnstile_affinity.app import create_app
from turnstile_affinity.settings import AffinitySettings
from turnstile_contracts import affinity_pb2, affinity_pb2_grpc
from turnstile_platform import sandbox_credentials
from turnstile_platform.log_throttle import LogThrottle
from turnstile_platform.sandbox_credentials import (
    CredentialIssuer,
    SigningKey,
    generate_key_pair,
)
from turnstile_platform.tiers import TIER_LABEL
from turnstile_testing.processes import RedisProcess

EOF: Any = grpc.aio.EOF  # type: ignore[attr-defined]
UNBOUND = {
    "relay_heartbeats_per_interval": 1000,
    "relay_heartbeat_burst": 10_000,
    "relay_renewals_per_minute": 6000,
    "relay_renewal_burst": 1000,
}


class Lines(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


async def _scripts(redis: aioredis.Redis) -> int:
    stats = await redis.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("eval", "evalsha"))


def _hello(sandbox_id: str, credential: str) -> affinity_pb2.AttachRequest:
    hello = affinity_pb2.Hello(
        sandbox_id=sandbox_id, capacity=2, labels={TIER_LABEL: "a"}, credential=credential
    )
    return affinity_pb2.AttachRequest(hello=hello)


async def _flood(
    stub: Any,
    hello: affinity_pb2.AttachRequest,
    message: affinity_pb2.AttachRequest,
    seconds: float,
) -> tuple[int, int, float]:
    """(acks, acceptances, seconds) of one stream writing ``message`` for ``seconds``."""
    call = stub.Attach(None)
    await call.write(hello)
    await call.read()
    acks = accepted = 0

    async def read() -> None:
        nonlocal acks, accepted
        while (response := await call.read()) is not EOF:
            acks += response.HasField("heartbeat_ack")
            accepted += response.HasField("credential_accepted")

    reader = asyncio.ensure_future(read())
    started = time.monotonic()
    while time.monotonic() - started < seconds:
        await call.write(message)
    await call.write(affinity_pb2.AttachRequest(goodbye=affinity_pb2.Goodbye()))
    await reader
    return acks, accepted, time.monotonic() - started


async def _run(
    args: argparse.Namespace, label: str, overrides: dict[str, Any], throttled: bool
) -> None:
    keys = Path(tempfile.mkdtemp(prefix="turnstile-floods-"))
    generate_key_pair(keys / "signing.pem", keys / "public.pem")
    server = RedisProcess().start()
    redis = aioredis.Redis.from_url(server.url)
    settings = AffinitySettings(
        redis_url=server.url,  # type: ignore[arg-type]  # pydantic parses the string
        redis_prefix="bench:",
        port=0,
        metrics_port=0,
        wake_enabled=False,
        plaintext=True,
        log_format="text",
        shutdown_grace_s=0.2,
        worker_credential_public_keys_file=keys / "public.pem",
        **overrides,
    )
    app = await create_app(settings)
    await app.start()
    issuer = CredentialIssuer(
        SigningKey.from_file(keys / "signing.pem"), redis, "bench:", ttl_s=3600
    )
    checks = 0
    verify = sandbox_credentials.VerificationKeys.verify

    def counted(self: Any, credential: str, sandbox_id: str) -> Any:
        nonlocal checks
        checks += 1
        return verify(self, credential, sandbox_id)

    sandbox_credentials.VerificationKeys.verify = counted  # type: ignore[method-assign,assignment]
    # Unthrottled (an interval of 0) is how the relay logged refusals before SPEC O6.
    attestation.REFUSAL_LINES = LogThrottle(attestation.log, interval_s=60 if throttled else 0)
    lines = Lines()
    logging.getLogger("turnstile_affinity").addHandler(lines)
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{app.port}") as channel:
            stub = affinity_pb2_grpc.AffinityServiceStub(channel)
            issued = await issuer.issue("b")
            hello = _hello("b", issued.credential)
            heartbeat = affinity_pb2.AttachRequest(heartbeat=affinity_pb2.Heartbeat())
            before = await _scripts(redis)
            acks, _, took = await _flood(stub, hello, heartbeat, args.seconds)
            scripts = await _scripts(redis) - before - 2  # less the Hello's attach and the detach
            print(
                f"{label}: heartbeat flood {took:.1f}s: {acks} acks ({acks / took:.1f}/s), "
                f"{scripts} Redis scripts ({scripts / took:.1f}/s)"
            )
            renewed = await issuer.renew("b", issued.generation)
            assert renewed is not None
            renewal = affinity_pb2.AttachRequest(
                renewal=affinity_pb2.CredentialRenewal(credential=renewed.credential)
            )
            checks = 0
            _, accepted, took = await _flood(
                stub, _hello("b", renewed.credential), renewal, args.seconds
            )
            checks -= 1  # the Hello's
            print(
                f"{label}: renewal flood {took:.1f}s: {checks} signature checks "
                f"({checks / took:.1f}/s), {accepted} accepted ({accepted / took:.1f}/s)"
            )
            forged = renewed.credential[:-4] + (
                "AAAA" if not renewed.credential.endswith("AAAA") else "BBBB"
            )
            lines.count = 0
            started = time.monotonic()
            for start in range(0, 2000, 100):

                async def refused(i: int) -> None:
                    call = stub.Attach(None)
                    await call.write(_hello(f"sb-{i}", forged))
                    await call.code()

                await asyncio.gather(*(refused(i) for i in range(start, start + 100)))
            print(
                f"{label}: 2000 refused Hellos in {time.monotonic() - started:.1f}s: "
                f"{lines.count} log lines"
            )
    finally:
        sandbox_credentials.VerificationKeys.verify = verify  # type: ignore[method-assign]
        logging.getLogger("turnstile_affinity").removeHandler(lines)
        await app.stop()
        await redis.aclose()
        server.stop()


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=5.0)
    args = parser.parse_args()
    await _run(args, "before (budgets unbound, lines unthrottled)", UNBOUND, throttled=False)
    await _run(args, "after (default budgets, lines throttled)", {}, throttled=True)


if __name__ == "__main__":
    asyncio.run(main())
