"""The command line as docs/cli.md says: common options before or after the verb,
a guess for a mistyped option, usage errors in one line and a hint (JSON under
``--json``), one client-id parser everywhere, one verb set with the old verbs as
hidden aliases, ``status -o name``, and a ``--watch`` that SIGTERM ends at once."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import AsyncIterator

import pytest

from turnstile_cli.cli import run
from turnstile_cli.completion import script
from turnstile_cli.exits import Exit
from turnstile_cli.parser import build_parser, parse
from turnstile_platform.server import GrpcService
from turnstile_testing.probe import settings


def _refused(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[str, str]:
    """A command line refused before anything runs: exit 2; its stdout and stderr."""
    with pytest.raises(SystemExit) as exited:
        run(list(argv))
    assert exited.value.code == Exit.USAGE
    captured = capsys.readouterr()
    return captured.out, captured.err


@pytest.mark.parametrize(
    ("argv", "output"),
    [
        (["limits", "get", "-o", "json"], "json"),
        (["keys", "show", "-o", "yaml"], "yaml"),
        (["limits", "show", "acme", "--json"], None),
        (["keys", "allow", "acme", "-o", "name"], "name"),
        (["hold", "commit", "h-1", "-o", "wide"], "wide"),
    ],
)
def test_common_options_are_taken_after_the_verb(argv: list[str], output: str | None) -> None:
    args = parse(build_parser(), [*argv, "-q", "--stack", "/src/a", "--timeout", "3"])
    assert args.output == output
    assert (args.quiet, args.stack, args.timeout) == (True, "/src/a", 3.0)
    if "--json" in argv:
        assert args.json


@pytest.mark.parametrize(
    ("argv", "guess"),
    [
        (["usage", "--clinet", "acme"], "did you mean --client?"),
        (["activate", "sb-x", "--client", "acme", "--dryrun"], "did you mean --dry-run?"),
        (["limits", "set", "acme", "{}", "--jsno"], "did you mean --json?"),
    ],
)
def test_a_mistyped_option_gets_a_guess_in_one_line_and_a_hint(
    capsys: pytest.CaptureFixture[str], argv: list[str], guess: str
) -> None:
    out, err = _refused(capsys, *argv)
    assert out == ""
    message, hint = err.splitlines()  # no usage block: that is for --help
    assert message.startswith(f"turnstilectl {argv[0]}")
    assert f"unrecognized option {argv[-1] if argv[-1].startswith('-') else argv[1]}" in message
    assert guess in message
    assert (
        hint
        == f"see: turnstilectl {' '.join(argv[:2] if argv[0] == 'limits' else argv[:1])} --help"
    )


def test_a_usage_error_under_json_is_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    out, err = _refused(capsys, "usage", "--clinet", "acme", "--json")
    assert err == ""
    error = json.loads(out)["error"]
    assert (error["code"], error["reason"]) == ("INVALID_ARGUMENT", "USAGE")
    assert "did you mean --client?" in error["message"]
    assert error["hint"] == "see: turnstilectl usage --help"
    out, _ = _refused(capsys, "-o", "json", "sandboxes", "--limit", "-5")
    assert "-5 is negative" in json.loads(out)["error"]["message"]


@pytest.mark.parametrize(
    "argv",
    [
        ["activate", "sb-x", "--client", "ACME/../x"],
        ["usage", "--client", "bad id!"],
        ["keys", "allow", "bad id!"],
        ["limits", "set", "bad id!", '{"cap": 1}'],
        ["place", "s-1", "--client", "native"],
        ["sandboxes", "--client", " acme"],
    ],
)
def test_an_invalid_client_id_exits_2_with_the_reason_and_the_rule(
    capsys: pytest.CaptureFixture[str], argv: list[str]
) -> None:
    _, err = _refused(capsys, *argv)
    message = err.splitlines()[0]
    assert "is not a client id (" in message
    assert "a client id is 1 to 63 letters, digits, '-', '_' or '.'" in message


def test_limits_show_is_the_verb_and_get_a_hidden_alias(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = build_parser()
    assert parse(parser, ["limits", "get", "acme"]).verb == "show"
    assert parse(parser, ["keys", "show"]).verb == "show"
    with pytest.raises(SystemExit):
        parse(parser, ["limits", "--help"])
    listed = capsys.readouterr().out
    assert "show" in listed
    assert not re.search(r"\bget\b", listed.split("positional arguments:")[1])
    completion = script("bash", parser)
    assert "limits/show" in completion
    assert "limits/get" not in completion
    top = run_help(capsys)
    assert "show or change per-key limits" in top


def run_help(capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit):
        parse(build_parser(), ["--help"])
    return " ".join(capsys.readouterr().out.split())


@pytest.fixture
async def probe() -> AsyncIterator[str]:
    app = GrpcService("probe", settings(plaintext=True), service_names=[])
    await app.start()
    try:
        yield app.address
    finally:
        await app.stop()


async def test_status_o_name_prints_the_services_one_a_line(
    probe: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [f"--{s}={probe}" for s in ("admission", "substrate", "affinity")]
    code = await asyncio.to_thread(run, ["status", "-o", "name", *flags])
    assert code == Exit.OK
    assert capsys.readouterr().out == "admission\nsubstrate\naffinity\n"


def _watch(address: str) -> subprocess.Popen[str]:
    env = {**os.environ, "TURNSTILE_PLAINTEXT": "true"}
    return subprocess.Popen(
        [sys.executable, "-m", "turnstile_cli", "status", "--json", "--watch", "3600"]
        + [f"--{s}={address}" for s in ("admission", "substrate", "affinity")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
    )


async def test_sigterm_ends_a_watch_at_once_and_cleanly(probe: str) -> None:
    """Between rounds an hour apart: SIGTERM ends the wait, not the next round."""
    watch = await asyncio.to_thread(_watch, probe)
    try:
        assert watch.stdout is not None
        first = await asyncio.to_thread(watch.stdout.readline)  # one round shown
        assert json.loads(first)["admission"]["health"] == "SERVING"
        watch.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(watch.wait, 30)
        assert code == Exit.OK, watch.stderr.read() if watch.stderr else ""
    finally:
        watch.kill()
        watch.wait()
