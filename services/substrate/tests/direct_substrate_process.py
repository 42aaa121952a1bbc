"""A Direct substrate in a process of its own, for ``test_substrate_direct_secrets.py``.

The test starts this with secrets in its environment (so its
``/proc/<pid>/environ`` holds them, as a real substrate's would), and its
settings as ``TURNSTILE_*`` variables, read the way the service reads them. On
stdin: one JSON line (Redis URL and prefix for the sandbox credentials, the
sandbox ids to start, in order), then any line to stop them all. On stdout: one
JSON line per runtime started, then ``{"stopped": [...]}``.

It adds its own ``/proc/<pid>/environ`` to ``PRY_TARGETS`` (the paths the test's
prying runtimes try to read), since only it knows its pid before its runtimes start.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys

import redis.asyncio as aioredis

from turnstile_platform.sandbox_credentials import CredentialIssuer, SigningKey
from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.runtime import RuntimeSpec
from turnstile_substrate.settings import SubstrateSettings


async def no_gate() -> None:
    return None


def say(message: object) -> None:
    print(json.dumps(message), flush=True)


async def main() -> int:
    config = json.loads(sys.stdin.readline())
    own = f"/proc/{os.getpid()}/environ"
    os.environ["PRY_TARGETS"] = ":".join(filter(None, [os.environ.get("PRY_TARGETS"), own]))
    settings = SubstrateSettings()
    assert settings.worker_credential_signing_key_file is not None
    client = aioredis.from_url(config["redis_url"])
    signing = SigningKey.from_file(settings.worker_credential_signing_key_file)
    issuer = CredentialIssuer(signing, client, config["redis_prefix"], ttl_s=3600)
    substrate = DirectSubstrate(settings, issuer)
    await substrate.start()
    try:
        for sandbox_id in config["sandboxes"]:
            spec = RuntimeSpec(sandbox_id=sandbox_id, tier="", client_label="acme")
            await substrate.ensure_runtime(spec, substrate.plan(spec), no_gate)
            say({"started": sandbox_id})
        await asyncio.to_thread(sys.stdin.readline)
        stopped = [
            sandbox_id
            for sandbox_id in config["sandboxes"]
            if await substrate.stop_runtime(sandbox_id)
        ]
        say({"stopped": stopped})
    finally:
        await substrate.close()
        await client.aclose()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
