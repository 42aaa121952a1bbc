"""``turnstilectl tiers`` against every case of the shared fixture (SPEC T2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from turnstile_cli.cli import run

FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "tiers.json"
CASES: dict[str, list[dict[str, Any]]] = json.loads(FIXTURE.read_text(encoding="utf-8"))


def _tiers(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> tuple[int, dict[str, Any]]:
    """Run the case the way an operator would: through the environment variables."""
    for name, value in (
        ("TURNSTILE_TIERS", case["tiers"]),
        ("TURNSTILE_DEFAULT_TIER", case["default_tier"]),
        ("TURNSTILE_TIER_SETTINGS", case.get("tier_settings")),
    ):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    # No running local stack to fall back on (tested below).
    monkeypatch.setenv("TURNSTILE_STACK_FILE", "/nonexistent/stack.json")
    code = run(["tiers", "--json"])
    answer: dict[str, Any] = json.loads(capsys.readouterr().out)
    answer.pop("source", None)
    return code, answer


@pytest.mark.parametrize("case", CASES["valid"], ids=lambda c: c["name"])
def test_every_valid_fixture_case_is_valid_with_its_tiers_and_default(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, answer = _tiers(case, monkeypatch, capsys)
    assert code == 0
    assert answer == {
        "valid": True,
        "declared": case["declared"],
        "default": case["default"],
        "enabled": bool(case["declared"]),
    }


@pytest.mark.parametrize("case", CASES["invalid"], ids=lambda c: c["name"])
def test_every_invalid_fixture_case_exits_1_naming_the_setting(
    case: dict[str, Any], monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    code, answer = _tiers(case, monkeypatch, capsys)
    assert code == 1
    assert answer["valid"] is False
    assert answer["field"] == case["field"]
    assert case["error"] in answer["error"]


def test_options_override_the_environment(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("TURNSTILE_TIERS", "not valid!")
    assert run(["tiers", "--tiers", "gpu,cpu", "--default-tier", "cpu", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["default"] == "cpu"


def test_human_output_names_the_variable_to_fix(capsys: pytest.CaptureFixture[str]) -> None:
    assert run(["tiers", "--tiers", "a,,b", "--color", "never"]) == 1
    assert "TURNSTILE_TIERS" in capsys.readouterr().out


def test_a_new_shell_reads_the_running_stacks_tiers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from turnstile_cli.stack import state

    stack_file = tmp_path / ".run" / "stack.json"
    state.write(stack_file, {"tiers": "container,microvm", "default_tier": ""})
    monkeypatch.delenv("TURNSTILE_TIERS", raising=False)
    monkeypatch.delenv("TURNSTILE_DEFAULT_TIER", raising=False)
    monkeypatch.delenv("TURNSTILE_STACK_FILE", raising=False)
    monkeypatch.chdir(tmp_path)
    assert run(["tiers", "--json"]) == 0
    answer = json.loads(capsys.readouterr().out)
    assert answer["declared"] == ["container", "microvm"]
    assert answer["default"] == "container"
    assert str(stack_file) in answer["source"]
