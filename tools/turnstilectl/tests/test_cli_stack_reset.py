"""``up --reset``: one checkout's database, Redis prefix and sandboxes go; another
checkout's, on the same servers, stay; nothing goes unasked."""

from __future__ import annotations

import os
import pty
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis

from turnstile_cli.stack import state
from turnstile_cli.stack.config import LOCAL_POSTGRES, checkout_database_url, checkout_prefix
from turnstile_cli.stack.preflight import ensure_database


@dataclass(frozen=True)
class Checkout:
    root: Path

    @property
    def state_dir(self) -> Path:
        return self.root / ".run" / "direct"

    @property
    def database(self) -> str:
        return checkout_database_url(self.state_dir).rsplit("/", 1)[1]

    @property
    def prefix(self) -> str:
        return checkout_prefix(self.state_dir)


async def _databases() -> set[str]:
    admin = await asyncpg.connect(f"{LOCAL_POSTGRES}/postgres", timeout=5)
    try:
        return {r["datname"] for r in await admin.fetch("SELECT datname FROM pg_database")}
    finally:
        await admin.close()


async def _keys(redis: aioredis.Redis, prefix: str) -> set[bytes]:
    return {key async for key in redis.scan_iter(match=f"{prefix}*", count=1000)}


@pytest.fixture
async def checkouts(tmp_path: Path, redis_url: str) -> AsyncIterator[tuple[Checkout, Checkout]]:
    """Two checkouts whose stacks ran on the same PostgreSQL and Redis: each has its
    database, keys under its prefix and a sandbox directory. Cleaned up after."""
    pair = (Checkout(tmp_path / "one"), Checkout(tmp_path / "two"))
    redis = aioredis.from_url(redis_url, socket_timeout=5)
    for checkout in pair:
        await ensure_database(checkout_database_url(checkout.state_dir))
        await redis.set(f"{checkout.prefix}limits:acme", "{}")
        await redis.hset(f"{checkout.prefix}keyset", "acme", "1")
        (checkout.state_dir / "sb-1").mkdir(parents=True)
        (checkout.root / ".run" / "traces").mkdir()
        (checkout.root / ".run" / "traces" / "spans.jsonl").write_text("{}\n")
        (checkout.root / ".run" / "tls").mkdir()
        (checkout.root / ".run" / "tls" / "ca.crt").write_text("kept")
    try:
        yield pair
    finally:
        admin = await asyncpg.connect(f"{LOCAL_POSTGRES}/postgres", timeout=5)
        try:
            for checkout in pair:
                await admin.execute(f'DROP DATABASE IF EXISTS "{checkout.database}" WITH (FORCE)')
        finally:
            await admin.close()
        for checkout in pair:
            keys = await _keys(redis, checkout.prefix)
            if keys:
                await redis.unlink(*keys)
        await redis.aclose()


def _env(tmp_path: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TURNSTILE_", "OTEL_"))}
    env["XDG_STATE_HOME"] = str(tmp_path / "xdg-state")
    return env


def _reset_argv(redis_url: str, *extra: str) -> list[str]:
    return [
        *(sys.executable, "-m", "turnstile_cli", "up", "--reset"),
        *("--redis-url", redis_url, *extra),
    ]


def _reset(
    tmp_path: Path, checkout: Checkout, redis_url: str, *extra: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        _reset_argv(redis_url, *extra),
        cwd=checkout.root,
        env=_env(tmp_path),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def _assert_untouched(checkout: Checkout, redis: aioredis.Redis) -> None:
    assert checkout.database in await _databases()
    assert len(await _keys(redis, checkout.prefix)) == 2
    assert (checkout.state_dir / "sb-1").is_dir()


async def test_reset_with_yes_clears_only_this_checkouts_database_prefix_and_sandboxes(
    tmp_path: Path, redis_url: str, checkouts: tuple[Checkout, Checkout]
) -> None:
    one, two = checkouts
    redis = aioredis.from_url(redis_url, socket_timeout=5)
    try:
        done = _reset(tmp_path, one, redis_url, "--yes")

        assert done.returncode == 0, done.stderr
        assert "reset: dropped" in done.stderr
        assert one.database not in await _databases()
        assert await _keys(redis, one.prefix) == set()
        assert not (one.state_dir / "sb-1").exists()
        assert (one.root / ".run" / "tls" / "ca.crt").read_text() == "kept"
        assert not (one.root / ".run" / "traces" / "spans.jsonl").exists()
        assert (two.root / ".run" / "traces" / "spans.jsonl").exists()
        await _assert_untouched(two, redis)
    finally:
        await redis.aclose()


async def test_reset_refuses_without_a_terminal_and_without_yes(
    tmp_path: Path, redis_url: str, checkouts: tuple[Checkout, Checkout]
) -> None:
    one, _ = checkouts
    redis = aioredis.from_url(redis_url, socket_timeout=5)
    try:
        done = _reset(tmp_path, one, redis_url)

        assert done.returncode == 2, done.stderr
        assert "add --yes" in done.stderr
        await _assert_untouched(one, redis)
    finally:
        await redis.aclose()


async def test_reset_refuses_a_database_or_prefix_that_is_not_the_checkouts(
    tmp_path: Path, redis_url: str, checkouts: tuple[Checkout, Checkout]
) -> None:
    one, two = checkouts
    redis = aioredis.from_url(redis_url, socket_timeout=5)
    try:
        other_db = checkout_database_url(two.state_dir)
        by_database = _reset(tmp_path, one, redis_url, "--yes", "--database-url", other_db)
        by_prefix = _reset(tmp_path, one, redis_url, "--yes", "--redis-prefix", two.prefix)

        assert by_database.returncode == 2, by_database.stderr
        assert "this checkout's own database only" in by_database.stderr
        assert by_prefix.returncode == 2, by_prefix.stderr
        assert "this checkout's own Redis prefix only" in by_prefix.stderr
        await _assert_untouched(one, redis)
        await _assert_untouched(two, redis)
    finally:
        await redis.aclose()


async def test_reset_refuses_while_the_checkouts_stack_runs(
    tmp_path: Path, redis_url: str, checkouts: tuple[Checkout, Checkout]
) -> None:
    one, _ = checkouts
    # This test's own process stands for the running runner.
    state.write(state.path_for(one.state_dir), {"runner": state.process_record(os.getpid())})
    redis = aioredis.from_url(redis_url, socket_timeout=5)
    try:
        done = _reset(tmp_path, one, redis_url, "--yes")

        assert done.returncode == 1, done.stderr
        assert "a stack runs on this checkout" in done.stderr
        await _assert_untouched(one, redis)
    finally:
        await redis.aclose()


def _answer_on_a_terminal(
    tmp_path: Path, checkout: Checkout, redis_url: str, answer: bytes
) -> tuple[int, str]:
    """Run ``up --reset`` on a terminal (a pseudo-terminal) and answer its prompt."""
    master, slave = pty.openpty()
    proc = subprocess.Popen(
        _reset_argv(redis_url),
        cwd=checkout.root,
        env=_env(tmp_path),
        stdin=slave,
        stdout=slave,
        stderr=slave,
    )
    os.close(slave)
    screen = b""
    while b"Reset? [y/N]" not in screen:
        chunk = os.read(master, 4096)
        assert chunk, screen
        screen += chunk
    os.write(master, answer + b"\n")
    code = proc.wait(timeout=60)
    try:
        while chunk := os.read(master, 4096):
            screen += chunk
    except OSError:  # EIO: the terminal's other side is closed
        pass
    os.close(master)
    return code, screen.decode(errors="replace")


async def test_reset_on_a_terminal_asks_and_does_nothing_unless_told_yes(
    tmp_path: Path, redis_url: str, checkouts: tuple[Checkout, Checkout]
) -> None:
    one, two = checkouts
    redis = aioredis.from_url(redis_url, socket_timeout=5)
    try:
        code, screen = _answer_on_a_terminal(tmp_path, one, redis_url, b"n")
        assert code == 1, screen
        assert one.database in screen
        assert one.prefix in screen
        await _assert_untouched(one, redis)

        code, screen = _answer_on_a_terminal(tmp_path, one, redis_url, b"y")
        assert code == 0, screen
        assert one.database not in await _databases()
        assert await _keys(redis, one.prefix) == set()
        await _assert_untouched(two, redis)
    finally:
        await redis.aclose()
