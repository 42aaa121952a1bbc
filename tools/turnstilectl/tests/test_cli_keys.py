"""``turnstilectl keys`` changes the one key set in Redis, as the services read it."""

from __future__ import annotations

import json

import pytest
import redis.asyncio as aioredis

from turnstile_cli.cli import build_parser, run
from turnstile_cli.commands.base import load_handler
from turnstile_cli.context import Context
from turnstile_cli.output import Output
from turnstile_clientkeys import KeySetStore


async def _keys(
    capsys: pytest.CaptureFixture[str], redis_url: str, prefix: str, *argv: str
) -> tuple[int, dict[str, object]]:
    args = build_parser().parse_args(
        ["keys", "--redis-url", redis_url, "--redis-prefix", prefix, *argv]
    )
    code: int = await load_handler(args.handler)(args, Context(out=Output(json_mode=True)))
    return code, json.loads(capsys.readouterr().out)


async def test_allow_remove_and_flags_bump_the_version_the_store_reads(
    capsys: pytest.CaptureFixture[str],
    redis: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
) -> None:
    code, allowed = await _keys(capsys, redis_url, redis_prefix, "allow", "acme", "globex")
    assert code == 0
    assert allowed["allowlist"] == ["acme", "globex"]
    stored = await KeySetStore(redis, redis_prefix).load()
    assert stored.allowlist == {"acme", "globex"}
    assert stored.version == allowed["version"]

    _, removed = await _keys(capsys, redis_url, redis_prefix, "remove", "globex")
    _, flagged = await _keys(capsys, redis_url, redis_prefix, "flags", "own_keys=off")
    assert removed["allowlist"] == ["acme"]
    assert flagged["flags"] == {"own_keys": False}
    assert flagged["version"] == allowed["version"] + 2
    assert not (await KeySetStore(redis, redis_prefix).load()).flag("own_keys")


async def test_show_resolves_ids_as_the_services_would(
    capsys: pytest.CaptureFixture[str],
    redis: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
) -> None:
    await KeySetStore(redis, redis_prefix).change(allow=("acme", "Not A Label"))
    _, shown = await _keys(
        capsys, redis_url, redis_prefix, "show", "acme", "Not A Label", "stranger"
    )
    assert shown["resolved"] == {
        "acme": {"key": "acme", "kind": "own"},
        "Not A Label": {"key": "shared", "kind": "shared"},
        "stranger": {"key": "shared", "kind": "shared"},
    }


async def test_an_unknown_flag_is_a_usage_error_and_changes_nothing(
    capsys: pytest.CaptureFixture[str],
    redis: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
) -> None:
    code, answer = await _keys(capsys, redis_url, redis_prefix, "flags", "everything=on")
    assert code == 2
    assert "unknown flag" in answer["error"]["message"]  # type: ignore[index]
    assert await KeySetStore(redis, redis_prefix).version() is None


@pytest.mark.parametrize("client_id", ["", "   ", "a" * 64])
def test_allowing_an_invalid_client_id_is_a_usage_error_not_a_traceback(
    capsys: pytest.CaptureFixture[str], redis_url: str, redis_prefix: str, client_id: str
) -> None:
    argv = ["keys", "--redis-url", redis_url, "--redis-prefix", redis_prefix]
    with pytest.raises(SystemExit) as exited:
        run([*argv, "allow", client_id])
    captured = capsys.readouterr()
    assert exited.value.code == 2
    assert "client id" in captured.err
    assert "Traceback" not in captured.err
    assert captured.out == ""
