"""``up --reset``: start this checkout's local stack from nothing.

What a checkout's stack keeps between runs is its own by construction
(:mod:`.config`): the database ``turnstile_<checkout id>`` on the local server,
the Redis keys under ``turnstile:<checkout id>:`` (limits, the key set, counts,
queues, sessions) and the Direct substrate's state directory (each sandbox's
workspace and log). A reset drops that database, deletes those keys, empties
that directory and the span log beside it (``traces/``), and nothing else:
another checkout's database and prefix are never named, and a database or prefix
given explicitly (a flag, a ``TURNSTILE_*`` variable) is refused rather than
dropped, since it may be anybody's. The certificates and the sandbox-credential
keys are kept (a reset forgets state, not identities).

It asks first, on a terminal; without one it needs ``--yes``, and it refuses
while a stack runs on this checkout.
"""

from __future__ import annotations

import argparse
import re
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from turnstile_cli.exits import Exit
from turnstile_cli.output import Output
from turnstile_cli.stack import procs, state
from turnstile_cli.stack.config import checkout_database_url, checkout_prefix
from turnstile_cli.stack.otlp_receiver import FILE_NAME, PREVIOUS_NAME
from turnstile_cli.stack.preflight import redacted
from turnstile_platform.redis_client import create_redis

#: Keys deleted per round trip.
BATCH = 500
#: Each Redis and PostgreSQL call's bound (a local server answers in milliseconds).
TIMEOUT_S = 5.0


class ResetRefusedError(Exception):
    """The reset would touch what is not this checkout's, or was not confirmed."""

    def __init__(self, text: str, code: int = Exit.USAGE) -> None:
        super().__init__(text)
        self.code = code


@dataclass(frozen=True)
class Reset:
    """What a reset of one checkout's stack removes."""

    checkout: Path
    database_url: str
    redis_url: str
    redis_prefix: str
    state_dir: Path

    @property
    def traces_dir(self) -> Path:
        """The stack's span log (:mod:`.otlp_receiver`): traces of sandboxes now gone."""
        return state.path_for(self.state_dir).with_name("traces")

    @property
    def database(self) -> str:
        return urlsplit(self.database_url).path.lstrip("/")


def plan(args: argparse.Namespace) -> Reset:
    """The checkout's own state, or :class:`ResetRefusedError` when the arguments name
    a database or prefix that is not the checkout's own."""
    state_dir: Path = args.state_dir
    database_url = checkout_database_url(state_dir)
    prefix = checkout_prefix(state_dir)
    if args.database_url and args.database_url != database_url:
        raise ResetRefusedError(
            f"--reset drops this checkout's own database only ({redacted(database_url)}), "
            f"not {redacted(args.database_url)} (--database-url or TURNSTILE_DATABASE_URL): "
            "drop that one yourself"
        )
    if args.redis_prefix and args.redis_prefix != prefix:
        raise ResetRefusedError(
            f"--reset deletes this checkout's own Redis prefix only ({prefix}), not "
            f"{args.redis_prefix!r} (--redis-prefix or TURNSTILE_REDIS_PREFIX)"
        )
    return Reset(
        checkout=state_dir.absolute().parent.parent,
        database_url=database_url,
        redis_url=args.redis_url,
        redis_prefix=prefix,
        state_dir=state_dir.absolute(),
    )


def _glob_escaped(prefix: str) -> str:
    """``prefix`` as a literal in a Redis ``MATCH`` pattern."""
    return re.sub(r"([*?\[\]\\])", r"\\\1", prefix)


async def _keys(reset: Reset) -> list[bytes]:
    client = create_redis(reset.redis_url, timeout_s=TIMEOUT_S)
    try:
        pattern = _glob_escaped(reset.redis_prefix) + "*"
        return [key async for key in client.scan_iter(match=pattern, count=1000)]
    finally:
        await client.aclose()


async def _delete_keys(reset: Reset, keys: list[bytes]) -> None:
    client = create_redis(reset.redis_url, timeout_s=TIMEOUT_S)
    try:
        for start in range(0, len(keys), BATCH):
            # One key per command: on a Cluster the keys of a batch live in many slots.
            async with client.pipeline(transaction=False) as pipe:
                for key in keys[start : start + BATCH]:
                    pipe.unlink(key)
                await pipe.execute()
    finally:
        await client.aclose()


def _admin_url(reset: Reset) -> str:
    return urlunsplit(urlsplit(reset.database_url)._replace(path="/postgres"))


async def _database_exists(reset: Reset) -> bool:
    admin = await asyncpg.connect(_admin_url(reset), timeout=TIMEOUT_S)
    try:
        found = await admin.fetchval(
            "SELECT 1 FROM pg_database WHERE datname = $1", reset.database, timeout=TIMEOUT_S
        )
        return bool(found)
    finally:
        await admin.close()


async def _drop_database(reset: Reset) -> None:
    admin = await asyncpg.connect(_admin_url(reset), timeout=TIMEOUT_S)
    try:
        quoted = '"' + reset.database.replace('"', '""') + '"'
        # FORCE: a leftover connection (a service killed outright) must not block it.
        await admin.execute(f"DROP DATABASE IF EXISTS {quoted} WITH (FORCE)", timeout=TIMEOUT_S)
    finally:
        await admin.close()


def _running_stack(reset: Reset) -> int | None:
    """The pid of a stack running on this checkout's state, if one does."""
    description = state.read(state.path_for(reset.state_dir))
    runner = state.recorded_runner(description) if description is not None else None
    return runner.pid if runner is not None and procs.alive(runner) else None


def _confirm(out: Output, lines: list[str]) -> bool:
    for line in lines:
        out.err.print(line, soft_wrap=True, highlight=False, markup=False)
    out.err.print("Reset? [y/N] ", end="", markup=False)
    try:
        answer = input()
    except EOFError:
        return False
    return answer.strip().lower() in ("y", "yes")


async def run(args: argparse.Namespace, out: Output) -> int:
    """Reset this checkout's stack state; the exit code."""
    try:
        reset = plan(args)
        pid = _running_stack(reset)
        if pid is not None:
            raise ResetRefusedError(
                f"a stack runs on this checkout (pid {pid}): stop it (Ctrl-C) before --reset",
                Exit.ERROR,
            )
        if not args.yes and not sys.stdin.isatty():
            raise ResetRefusedError(
                "--reset asks first, and there is no terminal to ask: add --yes"
            )
        keys = await _keys(reset)
        exists = await _database_exists(reset)
    except ResetRefusedError as refused:
        out.failure(str(refused))
        return refused.code
    except (OSError, asyncpg.PostgresError) as error:
        out.failure(f"cannot reach the stores to reset them ({error}); ./scripts/up starts them")
        return Exit.ERROR
    sandboxes = (
        [p for p in reset.state_dir.iterdir() if p.is_dir()] if reset.state_dir.is_dir() else []
    )
    lines = [
        f"This resets the local stack of {reset.checkout}:",
        f"  PostgreSQL: drop database {reset.database} "
        + ("(every sandbox and session record)" if exists else "(not there)"),
        f"  Redis {redacted(reset.redis_url)}: delete the {len(keys)} key(s) under "
        f"{reset.redis_prefix} (limits, key set, counts, queues)",
        f"  {reset.state_dir}: {len(sandboxes)} sandbox director(y/ies) (workspaces and logs)",
        f"  {reset.traces_dir}: the span log turnstilectl traces reads",
        "Kept: other checkouts' databases and prefixes, the certificates and the "
        "sandbox-credential keys.",
    ]
    if not args.yes and not _confirm(out, lines):
        out.failure("not reset")
        return Exit.ERROR
    await _delete_keys(reset, keys)
    if exists:
        await _drop_database(reset)
    for name in (FILE_NAME, PREVIOUS_NAME):
        (reset.traces_dir / name).unlink(missing_ok=True)
    for directory in sandboxes:
        shutil.rmtree(directory, ignore_errors=True)
    out.note(
        f"reset: dropped {reset.database if exists else 'no database'}, deleted {len(keys)} "
        f"key(s) under {reset.redis_prefix}, removed {len(sandboxes)} sandbox director(y/ies); "
        "./scripts/up starts from nothing"
    )
    return Exit.OK
