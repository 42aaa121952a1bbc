"""``why``, ``decisions`` and ``admit --dry-run`` against the real admission service
on real Redis (SPEC Q3, Q4): what a person reads, and what a log shipper reads."""

from __future__ import annotations

import argparse
import asyncio
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc.aio
import pytest

from turnstile_admission.keys import AdmissionKeys
from turnstile_cli.cli import run
from turnstile_cli.commands import decisions
from turnstile_cli.commands.decisions import duration_s, newer_than
from turnstile_contracts import admission_pb2, admission_pb2_grpc
from turnstile_testing.eventually import eventually
from turnstile_testing.substrate import direct_substrate_settings, running_substrate

if TYPE_CHECKING:
    from conftest import StartAdmission


@pytest.fixture
async def admission(start_admission: StartAdmission) -> str:
    return await start_admission(client_allowlist=("acme", "globex"), cap={"default_cap": 1})


async def cli(capsys: pytest.CaptureFixture[str], address: str, *argv: str) -> tuple[int, str]:
    code = await asyncio.to_thread(run, [f"--admission={address}", "--color", "never", *argv])
    return code, capsys.readouterr().out


async def test_why_tells_what_refused_a_sandbox_in_plain_words(
    admission: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert (await cli(capsys, admission, "admit", "sb-1", "--client", "acme"))[0] == 0
    code, _ = await cli(capsys, admission, "admit", "sb-2", "--client", "acme")
    assert code == 3  # refused by the cap of 1
    code, out = await cli(capsys, admission, "why", "sb-2")
    assert code == 0
    assert "refused by the cap limit of key acme: 1 of 1 sandboxes live or pending" in out
    assert "trace " in out
    code, out = await cli(capsys, admission, "why", "sb-2", "--json")
    answer = json.loads(out)
    assert answer["decisions"][0]["kind"] == "refused"
    assert answer["decisions"][0]["why"].startswith("refused by the cap limit")
    code, out = await cli(capsys, admission, "why", "sb-never")
    assert code == 1
    assert "no decision about sandbox sb-never" in out


async def test_decisions_filters_and_follows_as_json_lines(
    admission: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await cli(capsys, admission, "admit", "sb-1", "--client", "acme")
    await cli(capsys, admission, "admit", "gx-1", "--client", "globex")
    code, out = await cli(capsys, admission, "decisions", "--client", "acme", "--json")
    assert code == 0
    assert [d["sandbox_id"] for d in json.loads(out)["decisions"]] == ["sb-1"]
    code, out = await cli(capsys, admission, "decisions", "--since", "10m")
    assert "sb-1" in out
    assert "gx-1" in out

    async def later() -> None:
        await asyncio.sleep(0.3)
        await asyncio.to_thread(
            run, [f"--admission={admission}", "admit", "sb-2", "--client", "acme", "--json"]
        )

    follower = asyncio.create_task(later())
    code = await asyncio.to_thread(
        run,
        [
            f"--admission={admission}",
            "decisions",
            "--follow",
            "-o",
            "json",
            "--interval",
            "0.2",
            "--polls",
            "8",
        ],
    )
    await follower
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines() if line]
    # One JSON object a line, oldest first, each entry once; the later admit's
    # refusal (cap of 1) arrived while following.
    sandboxes = [entry["sandbox_id"] for entry in lines if "sandbox_id" in entry]
    assert sandboxes == ["sb-1", "gx-1", "sb-2"]
    assert lines[-1]["kind"] == "refused"


async def test_a_follow_poll_reads_every_entry_newer_than_the_last_past_a_page(
    admission: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A burst bigger than a page between two polls reaches a follower whole."""
    monkeypatch.setattr(decisions, "PAGE", 2)
    await cli(capsys, admission, "admit", "sb-0", "--client", "acme")
    for n in range(1, 6):
        await cli(capsys, admission, "admit", f"sb-{n}", "--client", "acme")
    args = argparse.Namespace(client=None, sandbox=None, since=None)
    async with grpc.aio.insecure_channel(admission) as channel:
        stub = admission_pb2_grpc.AdmissionServiceStub(channel)
        everything = await stub.ListDecisions(admission_pb2.ListDecisionsRequest(limit=10))
        first = everything.decisions[-1]
        assert first.sandbox_id == "sb-0"
        fresh = await newer_than(stub, args, first.id)
    assert [d.sandbox_id for d in fresh] == ["sb-5", "sb-4", "sb-3", "sb-2", "sb-1"]


async def test_a_dry_run_admit_takes_nothing_and_logs_nothing(
    admission: str, capsys: pytest.CaptureFixture[str], redis: Any, redis_prefix: str
) -> None:
    keys = AdmissionKeys(redis_prefix)
    code, out = await cli(capsys, admission, "admit", "sb-1", "--client", "acme", "--dry-run")
    assert code == 0
    assert "dry run: nothing taken" in out
    # No stream of the log (any key's, the platform's) was written.
    assert [k async for k in redis.scan_iter(match=f"{redis_prefix}{{adm}}:decisions*")] == []
    assert await redis.zcard(keys.pending("acme")) == 0
    code, out = await cli(
        capsys, admission, "admit", "sb-1", "--client", "acme", "--dry-run", "--json"
    )
    answer = json.loads(out)
    assert answer["dry_run"] is True
    assert answer["hold_id"] == ""


def test_durations() -> None:
    assert duration_s("10m") == 600
    assert duration_s("1.5h") == 5400
    assert duration_s("500ms") == 0.5
    with pytest.raises(Exception, match="not a duration"):
        duration_s("ten minutes")


def test_why_says_how_long_a_decision_waited_in_the_fair_queue() -> None:
    entry = admission_pb2.LoggedDecision(service="admission", kind="admitted")
    entry.key.key = "acme"
    assert "fair queue" not in decisions.explain(entry)
    entry.waited.FromMilliseconds(1250)
    assert decisions.explain(entry) == (
        "admitted as key acme; after waiting 1.250s in the fair queue"
    )


async def test_why_shows_one_key_set_version_per_decision(
    start_admission: StartAdmission,
    database_url: str,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """An Activate is logged by admission (with the key set version it resolved the
    key with) and by the substrate (with none): both lines of the decision show
    admission's version, never a made-up v0 beside it."""
    admission = await start_admission(client_allowlist=("acme",))
    settings = direct_substrate_settings(
        database_url, redis_url, redis_prefix, admission, tmp_path / "direct"
    )
    async with running_substrate(settings) as app:
        flags = [f"--admission={admission}", f"--substrate={app.address}", "--color", "never"]
        activate = [*flags, "activate", "sb-1", "--client", "acme"]
        assert await asyncio.to_thread(run, activate) == 0
        capsys.readouterr()

        async def both_logged() -> list[dict[str, Any]]:
            await asyncio.to_thread(run, [*flags, "why", "sb-1", "--json"])
            logged = json.loads(capsys.readouterr().out)["decisions"]
            return logged if {d["service"] for d in logged} >= {"admission", "substrate"} else []

        logged = await eventually(both_logged, what="both services' entries of the activation")
        version = next(d["key"]["key_set_version"] for d in logged if d["service"] == "admission")
        assert int(version) > 0
        assert await asyncio.to_thread(run, [*flags, "why", "sb-1"]) == 0
    out = capsys.readouterr().out
    shown = re.findall(r"key set v(\d+)", out)
    assert shown == [str(version)] * len(logged), out


def test_why_tells_a_tenant_its_refusal_by_a_shared_limit_without_numbers() -> None:
    """What a scoped reader gets of a shared limit's verdict (no limit, no count)
    reads as contention, not as "0 of 0"."""
    entry = admission_pb2.LoggedDecision(service="admission", kind="refused")
    entry.key.key = "acme"
    entry.verdicts.add(
        policy=admission_pb2.POLICY_NODE_SLOTS,
        verdict=admission_pb2.VERDICT_REFUSE,
        detail="the cluster is contended",
    )
    assert decisions.explain(entry) == "refused for key acme: the cluster is contended"
