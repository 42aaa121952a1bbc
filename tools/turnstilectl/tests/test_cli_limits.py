"""``turnstilectl limits`` and ``keys`` against the real admission service over mTLS,
under the local stack's shipped policy (SPEC M1): an operator's certificate sets,
patches, reads and deletes limits (weight and level shown) and changes the key set,
each change in the decision log under its identity; a tenant's certificate is refused
with a plain message and exit 1; bad documents exit 2 naming the field and change
nothing. Nothing here writes Redis but the service."""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from turnstile_cli.cli import run
from turnstile_cli.exits import Exit
from turnstile_clientkeys import KeySetStore
from turnstile_clientkeys.limits import limits_key
from turnstile_testing.authz import redis_snapshot
from turnstile_testing.pki import Identity, Pki

if TYPE_CHECKING:
    from conftest import StartAdmission

POLICY = Path(__file__).resolve().parents[1] / "src/turnstile_cli/stack/authz-policy.toml"
OPERATOR = "spiffe://turnstile.local/operator/ops"


@dataclass
class Cli:
    address: str
    operator: Identity
    tenant: Identity
    redis: aioredis.Redis
    prefix: str
    capsys: pytest.CaptureFixture[str]

    async def __call__(
        self, *argv: str, who: str = "operator", json_mode: bool = True
    ) -> tuple[int, Any, str]:
        """Run ``turnstilectl`` as ``who``; exit code, stdout (parsed under --json), stderr."""
        identity = self.operator if who == "operator" else self.tenant
        flags = [
            f"--admission={self.address}",
            f"--cert={identity.cert_file}",
            f"--key={identity.key_file}",
            f"--ca={identity.ca_file}",
            "--color=never",
        ]
        if json_mode:
            flags.append("--json")
        try:
            code = await asyncio.to_thread(run, [*flags, *argv])
        except SystemExit as usage:  # a usage error, refused before any call
            code = int(usage.code or 0)
        captured = self.capsys.readouterr()
        out = json.loads(captured.out) if json_mode and captured.out else captured.out
        return code, out, " ".join(captured.err.split())

    async def stored(self) -> dict[str, Any]:
        raw = await self.redis.hgetall(limits_key(self.prefix))
        return {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}


@pytest.fixture
async def cli(
    start_admission: StartAdmission,
    tmp_path: Path,
    redis: aioredis.Redis,
    redis_prefix: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> Cli:
    monkeypatch.delenv("TURNSTILE_PLAINTEXT", raising=False)
    shipped = Pki(tmp_path / "pki", trust_domain="turnstile.local")
    address = await start_admission(
        client_allowlist=("acme",),
        **shipped.server_settings("service/admission", policy=POLICY.read_text()),
    )
    return Cli(
        address,
        shipped.identity("operator/ops"),
        shipped.identity("client/acme"),
        redis,
        redis_prefix,
        capsys,
    )


async def test_an_operator_sets_patches_gets_and_deletes_every_field(cli: Cli) -> None:
    code, made, err = await cli("limits", "set", "acme", '{"cap": 2, "rate": 1, "weight": 3}')
    assert code == Exit.OK, (made, err)
    assert made["limits"] == {"cap": 2, "rate": 1.0, "weight": 3.0}
    code, patched, _ = await cli(
        "limits", "patch", "acme", '{"level": "batch", "rate": null, "shadow": {"cap": 1}}'
    )
    assert code == Exit.OK
    assert patched["was"] == made["limits"]
    assert patched["limits"] == {"cap": 2, "weight": 3.0, "level": "batch", "shadow": {"cap": 1}}
    assert await cli.stored() == {"key:acme": patched["limits"]}

    code, one, _ = await cli("limits", "get", "acme")
    assert (code, one["limits"]) == (Exit.OK, patched["limits"])
    # The table shows every field, weight and level too.
    code, table, _ = await cli("limits", "get", json_mode=False)
    assert code == Exit.OK
    header = next(line for line in table.splitlines() if "concurrency" in line)
    assert [cell for cell in header.split() if cell.isalpha()] == [
        "for", "cap", "rate", "burst", "concurrency", "weight", "level", "shadow",
    ]  # fmt: skip
    row = next(line for line in table.splitlines() if line.startswith("│ acme"))
    assert "batch" in row
    assert "3.0" in row

    code, gone, _ = await cli("limits", "delete", "acme")
    assert (code, gone["deleted"]) == (Exit.OK, True)
    assert await cli.stored() == {}
    code, again, _ = await cli("limits", "delete", "acme")
    assert (code, again["deleted"]) == (Exit.ERROR, False)

    # Each change is in the decision log, readable by `decisions`, under the operator.
    code, log, _ = await cli("decisions")
    changes = [d for d in log["decisions"] if d["kind"] == "limits_changed"]
    assert [d["change"]["verb"] for d in changes] == ["delete", "patch", "set"]
    assert {d["identity"] for d in changes} == {OPERATOR}
    assert json.loads(changes[1]["change"]["current"])["level"] == "batch"
    assert changes[0]["why"].startswith(f"delete key:acme by {OPERATOR}")


async def test_set_says_what_it_replaced_and_a_key_not_allowlisted_is_warned_about(
    cli: Cli,
) -> None:
    await cli("limits", "set", "acme", '{"cap": 2, "rate": 1}')
    code, shown, _ = await cli("limits", "set", "acme", '{"cap": 3}', json_mode=False)
    assert code == Exit.OK
    assert "replaced the whole document" in " ".join(shown.split())
    code, newco, _ = await cli("limits", "set", "newco", '{"cap": 1}')
    assert code == Exit.OK
    assert "'newco' is not allowlisted" in newco["warning"]
    assert (await cli.stored())["key:newco"] == {"cap": 1}


async def test_default_and_cluster_documents(cli: Cli) -> None:
    await cli("limits", "set", "--default", '{"concurrency": 5}')
    await cli("limits", "set", "--cluster", '{"rate": 100, "burst": 400}')
    code, everything, _ = await cli("limits", "get")
    assert code == Exit.OK
    everything.pop("trace_id")
    assert everything == {
        "cluster": {"rate": 100.0, "burst": 400.0},
        "default": {"concurrency": 5},
    }
    code, one, _ = await cli("limits", "get", "--cluster")
    assert (code, one["limits"]) == (Exit.OK, {"rate": 100.0, "burst": 400.0})
    assert (await cli("limits", "get", "acme"))[0] == Exit.ERROR  # none stored


@pytest.mark.parametrize(
    ("argv", "why"),
    [
        # The server's checks: INVALID_ARGUMENT naming the field.
        (("set", "acme", '{"cap": -1}'), "limits.cap: cap must not be negative"),
        (("patch", "acme", '{"weight": 0}'), "limits.weight: weight must be greater than 0"),
        (("set", "--cluster", '{"cap": 1}'), "limits.cap: the cluster has only rate and burst"),
        (("set", "Not A Key!", '{"cap": 1}'), "is not a client id"),
        # What the message cannot carry, said before anything is sent.
        (("set", "acme", '{"cap": 1.5}'), "whole number"),
        (("set", "acme", '{"bogus": 1}'), "unknown limits: bogus"),
        (("set", "acme", '{"level": "urgent"}'), "level must be one of"),
        (("patch", "acme", "[1]"), "JSON object"),
        (("set", "acme", "{cap: 1}"), "not JSON"),
    ],
)
async def test_a_bad_document_exits_2_naming_the_field_and_changes_nothing(
    cli: Cli, argv: tuple[str, ...], why: str
) -> None:
    await cli("limits", "set", "acme", '{"cap": 2}')
    code, shown, _ = await cli("limits", *argv)
    assert code == Exit.USAGE
    error = shown["error"]
    assert why in error["message"] or why in json.dumps(error.get("field_violations", [])), error
    assert await cli.stored() == {"key:acme": {"cap": 2}}


#: What a tenant once did through `limits` (its own level and weight, another's cap)
#: and every other verb of `limits` and `keys`.
TENANT_TRIES = [
    ("limits", "patch", "acme", '{"level": "platform", "weight": 50}'),
    ("limits", "set", "globex", '{"cap": 0}'),
    ("limits", "delete", "--default"),
    ("limits", "show"),
    ("keys", "allow", "acme-2"),
    ("keys", "remove", "acme"),
    ("keys", "flags", "own_keys=off"),
    ("keys", "show"),
]


@pytest.mark.parametrize("argv", TENANT_TRIES, ids=" ".join)
async def test_a_tenants_certificate_is_refused_plainly_and_changes_nothing(
    cli: Cli, redis: aioredis.Redis, argv: tuple[str, ...]
) -> None:
    before = await redis_snapshot(redis, cli.prefix)
    code, out, err = await cli(*argv, who="tenant", json_mode=False)
    assert code == Exit.ERROR
    assert out == ""
    assert "permission denied: only an operator may read or change limits" in err
    assert "spiffe://turnstile.local/client/acme" in err
    assert "Traceback" not in err
    assert await redis_snapshot(redis, cli.prefix) == before
    code, answer, _ = await cli(*argv, who="tenant")
    assert code == Exit.ERROR
    assert answer["error"]["code"] == "PERMISSION_DENIED"


async def test_keys_allow_remove_flags_and_show_through_the_api(cli: Cli) -> None:
    code, allowed, _ = await cli("keys", "allow", "globex", "initech")
    assert code == Exit.OK
    assert allowed["allowlist"] == ["acme", "globex", "initech"]
    stored = await KeySetStore(cli.redis, cli.prefix).load()
    assert stored.allowlist == frozenset({"acme", "globex", "initech"})
    assert stored.version == allowed["version"]
    _, removed, _ = await cli("keys", "remove", "initech")
    _, flagged, _ = await cli("keys", "flags", "own_keys=off")
    assert removed["allowlist"] == ["acme", "globex"]
    assert flagged["flags"] == {"own_keys": False}
    assert flagged["version"] == allowed["version"] + 2
    await cli("keys", "flags", "own_keys=on")
    _, shown, _ = await cli("keys", "show", "globex", "stranger")
    assert shown["resolved"] == {
        "globex": {"key": "globex", "kind": "own"},
        "stranger": {"key": "shared", "kind": "shared"},
    }
    _, log, _ = await cli("decisions")
    changes = [d for d in log["decisions"] if d["kind"] == "keys_changed"]
    assert len(changes) == 4
    assert {d["identity"] for d in changes} == {OPERATOR}


@pytest.mark.parametrize(
    ("client_id", "field"),
    # Refused by the CLI's one client-id parser before any call (the server's own
    # checks, naming allow[0], are test_admission_admin's).
    [
        ("bad id!", "not a client id"),
        ("", "not a client id"),
        ("a" * 64, "not a client id"),
        ("native", "'native' is reserved"),
    ],
)
async def test_allowing_an_invalid_client_id_exits_2_and_changes_nothing(
    cli: Cli, client_id: str, field: str
) -> None:
    before = await KeySetStore(cli.redis, cli.prefix).load()
    code, out, err = await cli("keys", "allow", client_id, json_mode=False)
    assert code == Exit.USAGE
    assert field in err
    assert "Traceback" not in err
    assert out == ""
    assert await KeySetStore(cli.redis, cli.prefix).load() == before


async def test_an_unknown_flag_exits_2(cli: Cli) -> None:
    code, answer, _ = await cli("keys", "flags", "everything=on")
    assert code == Exit.USAGE
    assert "unknown flag" in json.dumps(answer["error"])
