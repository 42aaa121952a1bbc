"""The TypeScript/Node client's tests (clients/typescript/test) and its example against the real
local stack over mutual TLS: this starts the stack, gives a client id a limit of
one activation, and runs ``node --test`` with the stack's addresses and the CLI
certificate in the environment. Skipped only when ``node`` is not installed;
``./scripts/test`` installs the client's packages with ``npm ci``."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys import KeySetStore
from turnstile_clientkeys.limits import limits_key
from turnstile_testing.stack import run_stack

CLIENT_DIR = Path(__file__).resolve().parents[2] / "clients" / "typescript"
CLIENT_ID = "acme-ts"


@pytest.mark.timeout(120)
async def test_the_node_client_passes_against_the_stack(
    tmp_path: Path,
    redis: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
    database_url: str,
) -> None:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    assert (CLIENT_DIR / "node_modules" / "@grpc" / "grpc-js").is_dir(), (
        "the Node client's packages are not installed: run `npm ci` in clients/typescript"
    )
    await KeySetStore(redis, redis_prefix).change(allow=(CLIENT_ID,))
    await redis.hset(
        limits_key(redis_prefix), f"key:{CLIENT_ID}", json.dumps({"rate": 0.001, "burst": 1})
    )
    with run_stack(
        tmp_path, redis_url=redis_url, redis_prefix=redis_prefix, database_url=database_url
    ) as stack:
        await stack.wait_serving()
        env = {**stack.env(), "TURNSTILE_TS_CLIENT_ID": CLIENT_ID}
        result = await asyncio.to_thread(
            subprocess.run,
            [node, "--test", "--test-reporter=spec", "test/"],
            cwd=CLIENT_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        example = await asyncio.to_thread(
            subprocess.run,
            [node, "example.js"],
            cwd=CLIENT_DIR,
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
    assert example.returncode == 0, example.stdout + example.stderr
    assert "substrate: SERVING" in example.stdout, example.stdout
    assert "activated sb-example" in example.stdout, example.stdout
    # The server name is the derived one, never the dialled IP (RFC 6066 forbids IPs).
    assert "RFC 6066" not in example.stderr, example.stderr
    report = result.stdout + result.stderr
    assert "RFC 6066" not in report, report
    assert result.returncode == 0, report
    assert "# fail 0" in report or "fail 0" in report, report
    assert "skipped 0" in report or "# skip 0" in report, report
