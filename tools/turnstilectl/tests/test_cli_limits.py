"""``turnstilectl limits`` changes the limits hash admission's script reads: set
replaces and says so, patch merges, delete falls back, bad documents change nothing,
and a key nobody resolves to is warned about."""

from __future__ import annotations

import json
from typing import Any

import pytest
import redis.asyncio as aioredis

from turnstile_cli.cli import build_parser
from turnstile_cli.commands.base import load_handler
from turnstile_cli.context import Context
from turnstile_cli.output import Output
from turnstile_clientkeys import KeySetStore
from turnstile_clientkeys.limits import limits_key


class Limits:
    def __init__(
        self, capsys: pytest.CaptureFixture[str], redis: aioredis.Redis, url: str, prefix: str
    ) -> None:
        self.capsys, self.redis, self.url, self.prefix = capsys, redis, url, prefix

    async def __call__(self, *argv: str, json_mode: bool = True) -> tuple[int, Any]:
        args = build_parser().parse_args(
            ["limits", "--redis-url", self.url, "--redis-prefix", self.prefix, *argv]
        )
        out = Output(json_mode=json_mode)
        code: int = await load_handler(args.handler)(args, Context(out=out))
        captured = self.capsys.readouterr()
        return code, json.loads(captured.out) if json_mode else captured.out

    async def stored(self) -> dict[str, Any]:
        raw = await self.redis.hgetall(limits_key(self.prefix))
        return {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}


@pytest.fixture
async def limits(
    capsys: pytest.CaptureFixture[str], redis: aioredis.Redis, redis_url: str, redis_prefix: str
) -> Limits:
    await KeySetStore(redis, redis_prefix).change(allow=("acme",))
    return Limits(capsys, redis, redis_url, redis_prefix)


async def test_set_replaces_the_document_and_says_what_it_replaced(limits: Limits) -> None:
    assert (await limits("set", "acme", '{"cap": 2, "rate": 1}'))[0] == 0
    code, shown = await limits("set", "acme", '{"cap": 3}', json_mode=False)
    assert code == 0
    assert "replaced the whole document" in " ".join(shown.split())
    assert await limits.stored() == {"key:acme": {"cap": 3}}


async def test_patch_merges_and_null_removes_a_field(limits: Limits) -> None:
    await limits("set", "acme", '{"cap": 2, "rate": 1}')
    code, shown = await limits("patch", "acme", '{"burst": 4, "rate": null}')
    assert code == 0
    assert shown["limits"] == {"cap": 2, "burst": 4.0}
    assert shown["was"] == {"cap": 2, "rate": 1.0}
    assert await limits.stored() == {"key:acme": {"cap": 2, "burst": 4.0}}


async def test_delete_falls_back_and_a_second_delete_says_nothing_was_there(
    limits: Limits,
) -> None:
    await limits("set", "acme", '{"cap": 2}')
    assert (await limits("delete", "acme"))[0] == 0
    assert await limits.stored() == {}
    code, shown = await limits("delete", "acme")
    assert code == 1
    assert shown["deleted"] is False


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        (("set", "acme", '{"cap": -1}'), "cap must not be negative"),
        (("set", "acme", '{"cap": 1.5}'), "whole number"),
        (("set", "acme", '{"bogus": 1}'), "unknown limits: bogus"),
        (("patch", "acme", "[1]"), "JSON object"),
        (("set", "acme", "{cap: 1}"), "not JSON"),
        (("set", "--cluster", '{"cap": 1}'), "only rate and burst"),
    ],
)
async def test_a_bad_document_is_refused_and_changes_nothing(
    limits: Limits, argv: tuple[str, ...], why: str
) -> None:
    await limits("set", "acme", '{"cap": 2}')
    code, shown = await limits(*argv)
    assert code == 2
    assert why in shown["error"]["message"]
    assert await limits.stored() == {"key:acme": {"cap": 2}}


async def test_limits_for_a_key_nobody_resolves_to_are_stored_and_warned_about(
    limits: Limits,
) -> None:
    code, shown = await limits("set", "newco", '{"cap": 1}')
    assert code == 0
    assert "'newco' is not allowlisted" in shown["warning"]
    assert "turnstilectl keys allow newco" in shown["warning"]
    assert (await limits.stored())["key:newco"] == {"cap": 1}
    _, allowed = await limits("set", "acme", '{"cap": 1}')
    assert "warning" not in allowed


async def test_default_and_cluster_documents_and_get(limits: Limits) -> None:
    await limits("set", "--default", '{"concurrency": 5}')
    await limits("set", "--cluster", '{"rate": 100, "burst": 400}')
    code, everything = await limits("get")
    assert code == 0
    assert everything == {
        "cluster": {"rate": 100.0, "burst": 400.0},
        "default": {"concurrency": 5},
    }
    code, one = await limits("get", "--cluster")
    assert (code, one["limits"]) == (0, {"rate": 100.0, "burst": 400.0})
    assert (await limits("get", "acme"))[0] == 1  # none stored
