"""The TypeScript/Node client's tests (clients/typescript/test), its example and the
snippet of docs/clients.md against the real local stack over mutual TLS: this starts
the stack, gives a client id a limit of one activation, and runs ``node --test`` with
the stack's addresses and the CLI certificate in the environment, ``example.js`` with
client ids as arguments, and the docs' snippet from ``clients/typescript`` as the docs
say to run it. Skipped only when ``node`` is not installed; ``./scripts/test`` installs
the client's packages with ``npm ci``, and a test here checks that install is quiet."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys import KeySetStore
from turnstile_clientkeys.limits import limits_key
from turnstile_testing.stack import run_stack

ROOT = Path(__file__).resolve().parents[2]
CLIENT_DIR = ROOT / "clients" / "typescript"
CLIENTS_DOC = ROOT / "docs" / "clients.md"
CLIENT_ID = "acme-ts"
#: The example's other client: a key of its own with no limit set, so it is admitted.
OTHER_CLIENT = "globex-ts"
#: Where ./scripts/up writes the stack's certificates (README, "Getting a client certificate").
STACK_TLS_DIR = ROOT / ".run" / "tls"
DEFAULT_ADDRESSES = ("127.0.0.1:50051", "127.0.0.1:50052", "127.0.0.1:50053")


def docs_snippet() -> str:
    """The ES-module snippet of docs/clients.md's TypeScript section."""
    section = CLIENTS_DOC.read_text().split("## TypeScript / Node.js", 1)[1]
    (snippet,) = re.findall(r"```js\n(.*?)```", section, flags=re.S)
    return str(snippet)


def test_the_docs_snippet_names_the_stacks_files_relative_to_clients_typescript() -> None:
    """Run from clients/typescript, as the docs say, its paths are the stack's own."""
    snippet = docs_snippet()
    paths = re.findall(r'"(\.\./\.\./\.run/tls/[^"]+)"', snippet)
    assert len(paths) == 3, snippet
    for path in paths:
        assert (CLIENT_DIR / path).resolve().parent == STACK_TLS_DIR, path
    for address in DEFAULT_ADDRESSES:
        assert f'"{address}"' in snippet
    assert 'from "./src/client.js"' in snippet
    assert (CLIENT_DIR / "src" / "client.js").is_file()
    section = CLIENTS_DOC.read_text().split("## TypeScript / Node.js", 1)[1]
    assert "from\n`clients/typescript`" in section or "from `clients/typescript`" in section


def test_npm_ci_installs_with_no_warning(tmp_path: Path) -> None:
    """``npm ci`` of a copy of the client (its package.json and lock) prints no warning:
    the install script it would skip is declined in package.json."""
    npm = shutil.which("npm")
    if npm is None:
        pytest.skip("npm is not installed")
    for name in ("package.json", "package-lock.json"):
        shutil.copy(CLIENT_DIR / name, tmp_path / name)
    result = subprocess.run(
        [npm, "ci", "--no-audit", "--no-fund", "--offline"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if result.returncode != 0 and "ENOTCACHED" in result.stderr:
        pytest.skip("npm's cache does not hold the client's packages")
    assert result.returncode == 0, result.stderr
    assert "warn" not in (result.stdout + result.stderr).lower(), result.stdout + result.stderr


def test_the_engines_field_admits_what_the_client_uses() -> None:
    """``engines`` says Node >= 20; nothing needs a later minor (import.meta.dirname is 20.11)."""
    package = json.loads((CLIENT_DIR / "package.json").read_text())
    assert package["engines"]["node"] == ">=20"
    for path in [CLIENT_DIR / "example.js", *sorted((CLIENT_DIR / "src").glob("*.js"))]:
        assert "import.meta.dirname" not in path.read_text(), path
        assert "import.meta.filename" not in path.read_text(), path


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
    await KeySetStore(redis, redis_prefix).change(allow=(CLIENT_ID, OTHER_CLIENT))
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
        example = await run_node(node, env, "example.js", OTHER_CLIENT)
        refused = await run_node(node, env, "example.js", CLIENT_ID, "--sandbox", "sb-ts-9")
        usage = await run_node(node, env, "example.js")
        snippet_file = CLIENT_DIR / f"docs-snippet-{uuid.uuid4().hex[:8]}.mjs"
        snippet = docs_snippet().replace("../../.run/tls/", f"{stack.tls_dir}/")
        for default, address in zip(DEFAULT_ADDRESSES, stack.addresses, strict=True):
            snippet = snippet.replace(f'"{default}"', f'"{address}"')
        snippet_file.write_text(snippet)
        try:
            from_docs = await run_node(node, env, snippet_file.name)
        finally:
            snippet_file.unlink()
    assert example.returncode == 0, example.stdout + example.stderr
    assert "substrate: SERVING" in example.stdout, example.stdout
    assert "activated sb-example" in example.stdout, example.stdout
    assert f"charged to {OTHER_CLIENT}" in example.stdout, example.stdout
    assert "session chat-example" in example.stdout, example.stdout
    # The client from the argument: CLIENT_ID's one activation is used up above.
    assert refused.returncode == 0, refused.stdout + refused.stderr
    assert f"for key {CLIENT_ID}" in refused.stdout, refused.stdout
    assert usage.returncode == 2, usage.stdout + usage.stderr
    assert "usage: node example.js <client-id>" in usage.stderr
    assert from_docs.returncode == 0, from_docs.stdout + from_docs.stderr
    assert from_docs.stdout.splitlines()[0] == "SERVING", from_docs.stdout
    # The server name is the derived one, never the dialled IP (RFC 6066 forbids IPs).
    for run in (example, from_docs):
        assert "RFC 6066" not in run.stderr, run.stderr
    report = result.stdout + result.stderr
    assert "RFC 6066" not in report, report
    assert result.returncode == 0, report
    assert "# fail 0" in report or "fail 0" in report, report
    assert "skipped 0" in report or "# skip 0" in report, report


async def run_node(node: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return await asyncio.to_thread(
        subprocess.run,
        [node, *args],
        cwd=CLIENT_DIR,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
