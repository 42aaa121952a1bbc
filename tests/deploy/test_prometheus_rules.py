"""The Prometheus rules load and pass their unit tests (``promtool``), every alert
has a runbook section, and the Grafana dashboard is well-formed.

promtool comes with Debian's ``prometheus`` package, which ``./scripts/test``
installs when it is missing; without it these tests skip, saying so. That the
dashboard's queries return series is ``tests/e2e/test_e2e_dashboard.py``'s job.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "turnstile-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "turnstile-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "turnstile-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"

PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None,
    reason="promtool is not installed (Debian's prometheus package; ./scripts/test installs it)",
)


def _rules() -> list[dict[str, Any]]:
    document = yaml.safe_load(RULES.read_text())
    return [rule for group in document["groups"] for rule in group["rules"]]


def _alerts() -> list[dict[str, Any]]:
    return [rule for rule in _rules() if "alert" in rule]


@needs_promtool
def test_the_rules_load() -> None:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "check", "rules", str(RULES)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout + done.stderr


@needs_promtool
def test_the_rules_pass_their_unit_tests() -> None:
    assert PROMTOOL is not None
    done = subprocess.run(
        [PROMTOOL, "test", "rules", RULE_TESTS.name],
        cwd=RULE_TESTS.parent,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_every_alert_is_unit_tested_firing() -> None:
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    fired = {
        case["alertname"]
        for test in tests
        for case in test.get("alert_rule_test", [])
        if case.get("exp_alerts")
    }
    assert {alert["alert"] for alert in _alerts()} <= fired


def test_every_alert_has_a_severity_and_a_runbook_section() -> None:
    anchors = {
        re.sub(r"[^a-z0-9 -]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        for line in OPERATIONS.read_text().splitlines()
        if line.startswith("#")
    }
    for alert in _alerts():
        assert alert["labels"]["severity"] in {"page", "warning"}, alert["alert"]
        url = alert["annotations"]["runbook_url"]
        page, _, anchor = url.partition("#")
        assert page == "docs/operations.md", url
        assert anchor in anchors, f"{alert['alert']}: no section #{anchor} in {OPERATIONS.name}"


def test_the_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"]
    assert dashboard["title"]
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["query"] == "prometheus"
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        grid = panel["gridPos"]
        assert grid["x"] + grid["w"] <= 24, panel["title"]
        for target in panel["targets"]:
            assert target["expr"].strip(), panel["title"]
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]


def test_the_dashboard_uses_only_recording_rules_that_exist() -> None:
    recorded = {rule["record"] for rule in _rules() if "record" in rule}
    used = {
        name
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel["targets"]
        for name in re.findall(r"turnstile:[a-z0-9_:]+", target["expr"])
    }
    assert used <= recorded, used - recorded


def test_the_dashboard_shows_each_fair_share_level_in_flight_waiting_and_refused() -> None:
    """SPEC N1: an operator sees per level what is seated, waiting and refused."""
    exprs = " ".join(
        target["expr"]
        for panel in json.loads(DASHBOARD.read_text())["panels"]
        for target in panel["targets"]
    )
    for metric in (
        "turnstile_fair_share_in_flight",
        "turnstile_fair_share_assured_seats",
        "turnstile_fair_share_waiting",
        "turnstile_fair_share_refused_total",
    ):
        assert re.search(rf"by \([^)]*\blevel\b[^)]*\) \(\w*\(?{metric}", exprs), metric
