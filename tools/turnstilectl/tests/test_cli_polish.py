"""The small things a new user trips on: "did you mean", a partial answer for
several ids, a clear "no such sandbox", argument checks, paging, one status code
per headline, tables without trailing spaces in a pipe."""

from __future__ import annotations

import asyncio
import json
import signal
import sys
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
import yaml

from turnstile_cli.cli import run
from turnstile_cli.exits import Exit
from turnstile_cli.output import names, to_yaml
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    affinity_pb2,
    affinity_pb2_grpc,
    substrate_pb2,
    substrate_pb2_grpc,
)

Context = grpc.aio.ServicerContext[Any, Any]


class Substrate(substrate_pb2_grpc.SubstrateServiceServicer):
    """Knows ``idle`` (stopped) and lists two pages of sandboxes."""

    def __init__(self) -> None:
        self.page_tokens: list[str] = []

    async def Deactivate(
        self, request: substrate_pb2.DeactivateRequest, context: Context
    ) -> substrate_pb2.DeactivateResponse:
        return substrate_pb2.DeactivateResponse(stopped=False)

    async def GetSandbox(
        self, request: substrate_pb2.GetSandboxRequest, context: Context
    ) -> substrate_pb2.GetSandboxResponse:
        if request.sandbox_id != "idle":
            await context.abort(grpc.StatusCode.NOT_FOUND, f"no sandbox {request.sandbox_id}")
        return substrate_pb2.GetSandboxResponse(
            sandbox=substrate_pb2.Sandbox(
                sandbox_id="idle", state=substrate_pb2.SANDBOX_STATE_STOPPED
            )
        )

    async def ListSandboxes(
        self, request: substrate_pb2.ListSandboxesRequest, context: Context
    ) -> substrate_pb2.ListSandboxesResponse:
        self.page_tokens.append(request.page_token)
        start = int(request.page_token or "0")
        ids = [f"sb-{i}" for i in range(start, min(start + request.page_size, 5))]
        following = start + len(ids)
        return substrate_pb2.ListSandboxesResponse(
            sandboxes=[substrate_pb2.Sandbox(sandbox_id=i) for i in ids],
            next_page_token=str(following) if following < 5 else "",
        )


class Affinity(affinity_pb2_grpc.AffinityServiceServicer):
    async def GetSession(
        self, request: affinity_pb2.GetSessionRequest, context: Context
    ) -> affinity_pb2.GetSessionResponse:
        if request.session_id == "nope":
            await context.abort(grpc.StatusCode.NOT_FOUND, "no such session")
        return affinity_pb2.GetSessionResponse(
            session_id=request.session_id, client_id=request.client_id, sandbox_id="sb-1"
        )


class Admission(admission_pb2_grpc.AdmissionServiceServicer):
    async def GetUsage(
        self, request: admission_pb2.GetUsageRequest, context: Context
    ) -> admission_pb2.GetUsageResponse:
        await context.abort(grpc.StatusCode.PERMISSION_DENIED, "not allowed for this client")
        raise AssertionError("unreachable")


@pytest.fixture
async def servers() -> AsyncIterator[tuple[list[str], Substrate]]:
    server = grpc.aio.server()
    substrate = Substrate()  # type: ignore[abstract]
    substrate_pb2_grpc.add_SubstrateServiceServicer_to_server(substrate, server)
    affinity_pb2_grpc.add_AffinityServiceServicer_to_server(Affinity(), server)  # type: ignore[abstract]
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(Admission(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        yield [f"--{s}={address}" for s in ("admission", "substrate", "affinity")], substrate
    finally:
        await server.stop(None)


async def _cli(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = await asyncio.to_thread(run, ["--color", "never", *argv])
    captured = capsys.readouterr()
    return code, captured.out, " ".join(captured.err.split())


def test_a_mistyped_command_gets_a_did_you_mean(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run(["activte", "sb-1"])
    err = capsys.readouterr().err
    assert exited.value.code == Exit.USAGE
    assert "invalid choice: 'activte' — did you mean 'activate'" in err
    assert "choose from" not in err


def test_a_mistyped_verb_gets_one_too(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run(["keys", "alow", "acme"])
    assert "did you mean 'allow'?" in capsys.readouterr().err


def test_nothing_close_lists_the_choices(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        run(["zzzz"])
    assert "choose from 'admit'" in capsys.readouterr().err


def test_a_negative_limit_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run(["sandboxes", "--limit", "-5"])
    assert exited.value.code == Exit.USAGE
    assert "argument --limit: -5 is negative" in capsys.readouterr().err


async def test_sessions_shows_those_found_and_reports_the_missing_one(
    servers: tuple[list[str], Substrate], capsys: pytest.CaptureFixture[str]
) -> None:
    flags, _ = servers
    code, out, err = await _cli(capsys, *flags, "sessions", "a", "b", "nope", "--client", "acme")
    assert code == Exit.ERROR
    assert "2 session(s)" in out
    assert "no session nope of client acme" in err
    code, out, _ = await _cli(capsys, *flags, "--json", "sessions", "a", "nope", "--client", "acme")
    answer = json.loads(out)
    assert [s["session_id"] for s in answer["sessions"]] == ["a"]
    assert answer["missing"] == ["nope"]


async def test_deactivating_a_sandbox_that_does_not_exist_fails_clearly(
    servers: tuple[list[str], Substrate], capsys: pytest.CaptureFixture[str]
) -> None:
    flags, _ = servers
    code, _, err = await _cli(capsys, *flags, "deactivate", "does-not-exist")
    assert code == Exit.ERROR
    assert "no sandbox does-not-exist: nothing to stop" in err
    code, out, _ = await _cli(capsys, *flags, "deactivate", "idle")
    assert code == Exit.OK
    assert "idle had no running runtime" in out


async def test_a_listing_goes_on_from_its_next_page_token(
    servers: tuple[list[str], Substrate], capsys: pytest.CaptureFixture[str]
) -> None:
    flags, substrate = servers
    code, out, _ = await _cli(capsys, *flags, "--json", "sandboxes", "--limit", "2")
    first = json.loads(out)
    assert code == Exit.OK
    assert [s["sandbox_id"] for s in first["sandboxes"]] == ["sb-0", "sb-1"]
    token = first["next_page_token"]
    assert token
    code, out, _ = await _cli(
        capsys, *flags, "--json", "sandboxes", "--limit", "2", "--page-token", token
    )
    assert [s["sandbox_id"] for s in json.loads(out)["sandboxes"]] == ["sb-2", "sb-3"]
    assert substrate.page_tokens[-1] == token


async def test_a_status_code_without_a_reason_is_printed_once(
    servers: tuple[list[str], Substrate], capsys: pytest.CaptureFixture[str]
) -> None:
    flags, _ = servers
    code, _, err = await _cli(capsys, *flags, "usage", "--client", "acme")
    assert code == Exit.ERROR
    assert "✗ usage failed: PERMISSION_DENIED" in err
    assert err.count("PERMISSION_DENIED") == 1


async def test_an_unreachable_service_is_not_said_to_be_coming_soon(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = await _cli(capsys, "--admission=127.0.0.1:1", "usage", "--client", "acme")
    assert code == Exit.RETRYABLE
    assert "✗ usage failed: UNAVAILABLE" in err
    assert "not yet" not in err
    assert "(UNAVAILABLE)" not in err


async def test_piped_tables_end_their_lines_where_the_text_does(
    servers: tuple[list[str], Substrate], capsys: pytest.CaptureFixture[str]
) -> None:
    flags, _ = servers
    code, out, _ = await _cli(capsys, *flags, "sandboxes")
    assert code == Exit.OK
    lines = out.splitlines()
    assert any("sb-4" in line for line in lines)
    assert [line for line in lines if line != line.rstrip()] == []


async def test_output_name_prints_the_ids_one_a_line(
    servers: tuple[list[str], Substrate], capsys: pytest.CaptureFixture[str]
) -> None:
    flags, _ = servers
    code, out, _ = await _cli(capsys, *flags, "sandboxes", "-o", "name")
    assert code == Exit.OK
    assert out == "".join(f"sb-{i}\n" for i in range(5))
    code, out, _ = await _cli(capsys, *flags, "-o", "name", "sessions", "s1", "--client", "acme")
    assert out == "s1\n"


async def test_output_yaml_reads_back_as_the_json_payload(
    servers: tuple[list[str], Substrate], capsys: pytest.CaptureFixture[str]
) -> None:
    flags, _ = servers
    _, as_json, _ = await _cli(capsys, *flags, "--json", "sessions", "a", "nope", "--client", "x")
    code, as_yaml, _ = await _cli(
        capsys, *flags, "-o", "yaml", "sessions", "a", "nope", "--client", "x"
    )
    assert code == Exit.ERROR
    expected, parsed = json.loads(as_json), yaml.safe_load(as_yaml)
    expected.pop("trace_id")
    parsed.pop("trace_id")
    assert parsed == expected


def test_yaml_quotes_what_would_read_back_otherwise() -> None:
    data: dict[str, Any] = {
        "a": "yes",
        "b": "1.5",
        "c": "",
        "d": "x: y",
        "e": [],
        "f": {},
        "g": [[1, "on"]],
        "h": None,
    }
    assert yaml.safe_load(to_yaml(data)) == data


async def test_output_wide_never_cuts_a_table(
    servers: tuple[list[str], Substrate],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    flags, _ = servers
    monkeypatch.setenv("COLUMNS", "30")
    _, narrow, _ = await _cli(capsys, *flags, "sandboxes")
    _, wide, _ = await _cli(capsys, *flags, "sandboxes", "-o", "wide")
    assert "node/endpoint" not in narrow
    assert "node/endpoint" in wide
    assert max(map(len, wide.splitlines())) > 30


def test_name_of_one_object_is_its_own_id_not_its_clients() -> None:
    activated = {
        "sandbox": {"sandbox_id": "sb-1", "tier": "container"},
        "charged_client_id": "acme",
        "key": {"key": "acme", "kind": "KEY_KIND_OWN"},
    }
    assert names(activated) == ["sb-1"]
    assert names({"hold_id": "h-1", "key": {"key": "acme"}}) == ["h-1"]
    assert names({"key": {"key": "acme"}, "live": 1}) == ["acme"]


async def test_watch_shows_a_listing_again_until_ctrl_c(
    servers: tuple[list[str], Substrate],
) -> None:
    """A real process: two rounds (one JSON object a line), then Ctrl-C ends it, exit 0."""
    flags, substrate = servers
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnstile_cli",
        *flags,
        "--json",
        "sandboxes",
        "--limit",
        "2",
        "--watch",
        "0.2",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    try:
        rounds = [json.loads(await asyncio.wait_for(proc.stdout.readline(), 20)) for _ in range(2)]
    finally:
        proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), 20)
    assert [[s["sandbox_id"] for s in r["sandboxes"]] for r in rounds] == [["sb-0", "sb-1"]] * 2
    assert rounds[0]["trace_id"] != rounds[1]["trace_id"]  # each round is its own trace
    assert code == 0
    assert substrate.page_tokens.count("") >= 2


def test_watch_takes_a_sane_interval(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exited:
        run(["workers", "--watch", "0"])
    assert exited.value.code == Exit.USAGE
    assert "not between 0.1 and 3600 seconds" in capsys.readouterr().err


def test_usage_seen_by_a_tenant_says_the_cluster_bucket_is_not_shown() -> None:
    """A caller scoped to some clients gets no cluster bucket (its fields left out,
    so 0): "0.0 of 0" would read as an empty bucket refusing everything."""
    import io

    from rich.console import Console

    from turnstile_cli.commands.admission import render_usage

    def rendered(usage: admission_pb2.GetUsageResponse) -> str:
        out = io.StringIO()
        render_usage(Console(file=out, width=200, color_system=None), "acme", usage)
        return out.getvalue()

    tenant = rendered(admission_pb2.GetUsageResponse(client_capacity=20, client_tokens=20))
    assert "0.0 of 0" not in tenant
    assert "not shown to this identity" in tenant
    operator = rendered(admission_pb2.GetUsageResponse(cluster_tokens=150, cluster_capacity=200))
    assert "150.0 of 200" in operator


@pytest.mark.parametrize(
    ("why", "says"),
    [
        ("unsupported", "the substrate does not count live sandboxes"),
        ("unavailable", "no current count from the substrate's leader"),
    ],
)
def test_usage_explains_an_unknown_live_count(why: str, says: str) -> None:
    """Not just "unknown": why the count is missing and what the cap does meanwhile."""
    import io

    from rich.console import Console

    from turnstile_cli.commands.admission import render_usage

    out = io.StringIO()
    usage = admission_pb2.GetUsageResponse(live_unknown=why, pending=2, cap=5)
    render_usage(Console(file=out, width=300, color_system=None), "acme", usage)
    text = out.getvalue()
    assert says in text
    assert "2 pending of 5" in text
