"""The admin API through the real admission service over mTLS, under the shipped
policy (SPEC M1): an operator sets, patches, reads and deletes limits documents and
changes the key set; each change is one audit entry in the decision log with the
caller's identity and the documents before and after; bad input is INVALID_ARGUMENT
naming the field and changes nothing; concurrent patches keep each other's fields."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis
from google.protobuf import field_mask_pb2

from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_platform.errors import decode
from turnstile_testing.authz import redis_snapshot
from turnstile_testing.pki import Pki

REPO = Path(__file__).resolve().parents[3]
POLICY = REPO / "deploy/kustomize/base/authz-policy.toml"
TD = "spiffe://turnstile.local"
OPERATOR = f"{TD}/operator/ops"


def key(client_id: str) -> admission_pb2.LimitsTarget:
    return admission_pb2.LimitsTarget(client=common_pb2.ActivationClient(client_id=client_id))


DEFAULTS = admission_pb2.LimitsTarget(defaults=admission_pb2.LimitsTarget.Defaults())
CLUSTER = admission_pb2.LimitsTarget(cluster=admission_pb2.LimitsTarget.Cluster())


@dataclass
class Secured:
    admin: Any
    """An AdminService stub as the operator."""
    admission: Any
    """An AdmissionService stub as the operator."""
    running: Any
    pki: Pki
    address: str

    @property
    def prefix(self) -> str:
        return str(self.running.settings.redis_prefix)


@pytest.fixture
async def secured(start_admission: Any, tmp_path: Path) -> AsyncIterator[Secured]:
    shipped = Pki(tmp_path / "pki", trust_domain="turnstile.local")
    running = await start_admission(
        client_allowlist=("acme",),
        **shipped.server_settings("service/admission", policy=POLICY.read_text()),
    )
    address = running.app.address
    async with shipped.identity("operator/ops").channel(address) as channel:
        yield Secured(
            admission_pb2_grpc.AdminServiceStub(channel),
            admission_pb2_grpc.AdmissionServiceStub(channel),
            running,
            shipped,
            address,
        )


async def _audit(stub: Any) -> list[admission_pb2.LoggedDecision]:
    """The admin API's entries of the decision log, oldest first."""
    page = await stub.ListDecisions(admission_pb2.ListDecisionsRequest())
    found = [d for d in page.decisions if d.kind in ("limits_changed", "keys_changed")]
    return list(reversed(found))


def _doc(text: str) -> Any:
    return json.loads(text) if text else None


async def test_an_operator_sets_patches_reads_and_deletes_a_keys_limits(secured: Secured) -> None:
    admin = secured.admin
    limits = admission_pb2.Limits(
        cap=5, rate=2, burst=10, weight=3, level=admission_pb2.PRIORITY_LEVEL_BATCH
    )
    limits.shadow.cap = 2
    made = await admin.SetLimits(admission_pb2.SetLimitsRequest(target=key("acme"), limits=limits))
    assert not made.change.HasField("previous")
    assert made.change.limits == limits
    assert made.change.warning == ""

    patched = await admin.PatchLimits(
        admission_pb2.PatchLimitsRequest(
            target=key("acme"),
            limits=admission_pb2.Limits(concurrency=4, level=admission_pb2.PRIORITY_LEVEL_PLATFORM),
            update_mask=field_mask_pb2.FieldMask(paths=["concurrency", "level", "weight"]),
        )
    )
    assert patched.change.previous == limits
    now = patched.change.limits
    # Set fields took their values; weight was named and unset: removed.
    assert (now.cap, now.rate, now.burst, now.concurrency, now.shadow.cap) == (5, 2, 10, 4, 2)
    assert now.level == admission_pb2.PRIORITY_LEVEL_PLATFORM
    assert not now.HasField("weight")

    got = await admin.GetLimits(admission_pb2.GetLimitsRequest(target=key("acme")))
    (document,) = got.documents
    assert (document.name, document.limits) == ("key:acme", now)
    assert document.target == key("acme")

    # The decision script reads what the API wrote: a cap of 0 refuses acme at once.
    await admin.PatchLimits(
        admission_pb2.PatchLimitsRequest(target=key("acme"), limits=admission_pb2.Limits(cap=0))
    )
    refused = await secured.admission.Admit(
        admission_pb2.AdmitRequest(
            sandbox_id="sb-1",
            client=common_pb2.ActivationClient(client_id="acme"),
            kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
        )
    )
    assert refused.refused_by == admission_pb2.POLICY_CAP

    gone = await admin.DeleteLimits(admission_pb2.DeleteLimitsRequest(target=key("acme")))
    assert gone.deleted
    assert not gone.change.HasField("limits")
    again = await admin.DeleteLimits(admission_pb2.DeleteLimitsRequest(target=key("acme")))
    assert not again.deleted
    empty = await admin.GetLimits(admission_pb2.GetLimitsRequest(target=key("acme")))
    assert list(empty.documents) == []

    entries = await _audit(secured.admission)
    assert [e.change.verb for e in entries] == ["set", "patch", "patch", "delete"]
    assert {e.identity for e in entries} == {OPERATOR}
    assert {e.change.target for e in entries} == {"key:acme"}
    assert {e.key.key for e in entries} == {"acme"}
    first, second, _, last = entries
    assert _doc(first.change.previous) is None
    assert _doc(first.change.current)["level"] == "batch"
    assert _doc(second.change.previous) == _doc(first.change.current)
    assert _doc(second.change.current)["level"] == "platform"
    assert "weight" not in _doc(second.change.current)
    assert _doc(last.change.current) is None
    assert _doc(last.change.previous)["cap"] == 0


async def test_every_document_is_listed_with_every_field(secured: Secured) -> None:
    admin = secured.admin
    await admin.SetLimits(
        admission_pb2.SetLimitsRequest(target=CLUSTER, limits=admission_pb2.Limits(rate=80))
    )
    await admin.SetLimits(
        admission_pb2.SetLimitsRequest(
            target=DEFAULTS, limits=admission_pb2.Limits(concurrency=7, weight=2)
        )
    )
    native = admission_pb2.LimitsTarget(
        client=common_pb2.ActivationClient(native=common_pb2.ActivationClient.Native())
    )
    await admin.SetLimits(
        admission_pb2.SetLimitsRequest(
            target=native, limits=admission_pb2.Limits(level=admission_pb2.PRIORITY_LEVEL_PLATFORM)
        )
    )
    listed = await admin.GetLimits(admission_pb2.GetLimitsRequest())
    by_name = {d.name: d for d in listed.documents}
    assert set(by_name) == {"cluster", "default", "key:native"}
    assert by_name["cluster"].limits.rate == 80
    assert by_name["default"].limits.weight == 2
    assert by_name["key:native"].target == native
    assert by_name["key:native"].limits.level == admission_pb2.PRIORITY_LEVEL_PLATFORM


async def test_limits_of_a_key_not_allowlisted_are_stored_with_a_warning(
    secured: Secured,
) -> None:
    made = await secured.admin.SetLimits(
        admission_pb2.SetLimitsRequest(target=key("globex"), limits=admission_pb2.Limits(cap=3))
    )
    assert "'globex' is not allowlisted" in made.change.warning
    assert made.change.limits.cap == 3


def _patch(target: admission_pb2.LimitsTarget, **fields: Any) -> admission_pb2.PatchLimitsRequest:
    return admission_pb2.PatchLimitsRequest(target=target, limits=admission_pb2.Limits(**fields))


#: name → (request, the method, the field the BadRequest must name).
BAD: dict[str, tuple[Any, str, str]] = {
    "negative cap": (_patch(key("acme"), cap=-1), "PatchLimits", "limits.cap"),
    "cap too large": (_patch(key("acme"), cap=2_000_000), "PatchLimits", "limits.cap"),
    "zero rate": (_patch(key("acme"), rate=0), "PatchLimits", "limits.rate"),
    "burst below one": (_patch(key("acme"), burst=0.5), "PatchLimits", "limits.burst"),
    "zero weight": (_patch(key("acme"), weight=0), "PatchLimits", "limits.weight"),
    "unknown level": (_patch(key("acme"), level=9), "PatchLimits", "limits.level"),
    "nan rate": (_patch(key("acme"), rate=float("nan")), "PatchLimits", "limits.rate"),
    "negative shadow cap": (
        admission_pb2.SetLimitsRequest(
            target=key("acme"),
            limits=admission_pb2.Limits(shadow=admission_pb2.ShadowLimits(cap=-2)),
        ),
        "SetLimits",
        "limits.shadow.cap",
    ),
    "cluster cap": (_patch(CLUSTER, cap=5), "PatchLimits", "limits.cap"),
    "cluster weight": (
        admission_pb2.SetLimitsRequest(target=CLUSTER, limits=admission_pb2.Limits(weight=2)),
        "SetLimits",
        "limits.weight",
    ),
    "no target": (admission_pb2.SetLimitsRequest(), "SetLimits", "target"),
    "invalid key id": (_patch(key("bad id!"), cap=1), "PatchLimits", "target.client.client_id"),
    "empty key id": (_patch(key(""), cap=1), "PatchLimits", "target.client.client_id"),
    "reserved key id": (_patch(key("shared"), cap=1), "PatchLimits", "target.client.client_id"),
    "inherit": (
        _patch(
            admission_pb2.LimitsTarget(
                client=common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())
            ),
            cap=1,
        ),
        "PatchLimits",
        "target.client.inherit",
    ),
    "unknown mask path": (
        admission_pb2.PatchLimitsRequest(
            target=key("acme"), update_mask=field_mask_pb2.FieldMask(paths=["cap", "colour"])
        ),
        "PatchLimits",
        "update_mask.paths[1]",
    ),
    "allow an invalid id": (
        admission_pb2.UpdateKeySetRequest(allow=["globex", "bad id!"]),
        "UpdateKeySet",
        "allow[1]",
    ),
    "allow a reserved id": (
        admission_pb2.UpdateKeySetRequest(allow=["native"]),
        "UpdateKeySet",
        "allow[0]",
    ),
    "allow a blank id": (
        admission_pb2.UpdateKeySetRequest(allow=[" acme"]),
        "UpdateKeySet",
        "allow[0]",
    ),
    "unknown flag": (
        admission_pb2.UpdateKeySetRequest(flags={"own_keyz": False}),
        "UpdateKeySet",
        "flags['own_keyz']",
    ),
    "nothing to change": (admission_pb2.UpdateKeySetRequest(), "UpdateKeySet", "allow"),
}


@pytest.mark.parametrize("name", sorted(BAD))
async def test_bad_input_is_invalid_argument_naming_the_field_and_changes_nothing(
    name: str, secured: Secured, redis: aioredis.Redis
) -> None:
    request, method, field = BAD[name]
    await secured.admin.SetLimits(
        admission_pb2.SetLimitsRequest(target=key("acme"), limits=admission_pb2.Limits(cap=4))
    )
    await secured.admin.SetLimits(
        admission_pb2.SetLimitsRequest(target=CLUSTER, limits=admission_pb2.Limits(rate=9))
    )
    before = await redis_snapshot(redis, secured.prefix)
    logged = len(await _audit(secured.admission))
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await getattr(secured.admin, method)(request)
    rich = decode(refused.value)
    assert rich.code == grpc.StatusCode.INVALID_ARGUMENT, rich
    assert [v.field for v in rich.field_violations] == [field], rich
    assert await redis_snapshot(redis, secured.prefix) == before
    assert len(await _audit(secured.admission)) == logged


async def test_concurrent_patches_of_two_replicas_keep_each_others_fields(
    secured: Secured, start_admission: Any
) -> None:
    """Each round, six patches of six different fields of one document race, split
    over two replicas: a read-modify-write that is not one transaction loses some."""
    other = await start_admission(
        client_allowlist=("acme",),
        **secured.pki.server_settings("service/admission", policy=POLICY.read_text()),
    )
    async with secured.pki.identity("operator/ops").channel(other.app.address) as channel:
        stubs = [secured.admin, admission_pb2_grpc.AdminServiceStub(channel)]
        fields: dict[str, Any] = {
            "cap": 3,
            "rate": 1.5,
            "burst": 6,
            "concurrency": 2,
            "weight": 4,
            "level": admission_pb2.PRIORITY_LEVEL_BATCH,
        }
        for _ in range(10):
            await secured.admin.DeleteLimits(admission_pb2.DeleteLimitsRequest(target=key("acme")))
            await asyncio.gather(
                *(
                    stubs[i % 2].PatchLimits(_patch(key("acme"), **{name: value}))
                    for i, (name, value) in enumerate(fields.items())
                )
            )
            got = await secured.admin.GetLimits(admission_pb2.GetLimitsRequest(target=key("acme")))
            (document,) = got.documents
            assert {name: getattr(document.limits, name) for name in fields} == fields
    # Every patch is in the log: 10 rounds of 6 (and the deletes of rounds 2 to 10).
    entries = await _audit(secured.admission)
    assert sum(1 for e in entries if e.change.verb == "patch") == 60


async def test_the_key_set_changes_through_the_api_and_is_audited(secured: Secured) -> None:
    admin = secured.admin
    shown = await admin.GetKeySet(admission_pb2.GetKeySetRequest(client_ids=["acme", "globex"]))
    assert list(shown.key_set.allowlist) == ["acme"]
    assert [(r.client_id, r.key.key) for r in shown.resolved] == [
        ("acme", "acme"),
        ("globex", "shared"),
    ]
    changed = await admin.UpdateKeySet(
        admission_pb2.UpdateKeySetRequest(allow=["globex"], remove=["acme"])
    )
    assert list(changed.previous.allowlist) == ["acme"]
    assert list(changed.key_set.allowlist) == ["globex"]
    assert changed.key_set.version == changed.previous.version + 1
    flags = await admin.UpdateKeySet(admission_pb2.UpdateKeySetRequest(flags={"own_keys": False}))
    assert dict(flags.key_set.flags) == {"own_keys": False}

    (first, second) = await _audit(secured.admission)
    assert (first.kind, first.identity, first.change.target) == ("keys_changed", OPERATOR, "keyset")
    assert _doc(first.change.previous)["allowlist"] == ["acme"]
    assert _doc(first.change.current)["allowlist"] == ["globex"]
    assert _doc(second.change.current)["flags"] == {"own_keys": False}


async def test_audit_entries_reach_a_consumer_group(
    secured: Secured, redis: aioredis.Redis
) -> None:
    """The export docs/operations.md documents ships the admin API's entries too."""
    stream = secured.running.keys.platform_decisions
    await redis.xgroup_create(stream, "shipper", id="$", mkstream=True)
    await secured.admin.SetLimits(
        admission_pb2.SetLimitsRequest(target=DEFAULTS, limits=admission_pb2.Limits(cap=9))
    )
    got: Any = await redis.xreadgroup("shipper", "s1", {stream: ">"})
    ((_, fields),) = got[0][1]
    assert fields[b"kind"] == b"limits_changed"
    assert fields[b"identity"] == OPERATOR.encode()
    assert json.loads(fields[b"current"]) == {"cap": 9}


async def test_the_break_glass_script_says_so_and_is_audited_too(
    redis: aioredis.Redis, redis_url: str, redis_prefix: str
) -> None:
    """``turnstile-admission-limits`` writes Redis without the API (for when admission
    cannot answer): it warns, validates with the same parser and logs the change."""
    import getpass
    import os
    import subprocess
    import sys

    from turnstile_clientkeys.limits import LimitsStore
    from turnstile_platform.decision_log import platform_stream

    env = {**os.environ, "TURNSTILE_REDIS_URL": redis_url, "TURNSTILE_REDIS_PREFIX": redis_prefix}

    def script(*argv: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "turnstile_admission.limits_cli", *argv],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )

    done = await asyncio.to_thread(script, "set", "acme", '{"cap": 5, "level": "batch"}')
    assert done.returncode == 0, done.stderr
    assert "BREAK-GLASS" in done.stderr
    assert await LimitsStore(redis, redis_prefix).get("key:acme") == {"cap": 5, "level": "batch"}
    bad = await asyncio.to_thread(script, "set", "acme", '{"weight": 0}')
    assert bad.returncode == 2
    assert await LimitsStore(redis, redis_prefix).get("key:acme") == {"cap": 5, "level": "batch"}
    entries: Any = await redis.xrange(platform_stream(redis_prefix))
    assert len(entries) == 1
    fields = entries[0][1]
    assert fields[b"kind"] == b"limits_changed"
    assert fields[b"identity"] == f"break-glass:{getpass.getuser()}".encode()
    assert json.loads(fields[b"current"]) == {"cap": 5, "level": "batch"}
