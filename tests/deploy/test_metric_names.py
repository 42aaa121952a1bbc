"""Every metric the Prometheus rules, their promtool tests and the Grafana dashboard
name is one the code defines, with the labels they use; every defined metric is
documented in docs/operations.md.

Rules written ahead of the code they watch (or left behind by a rename) evaluate to
nothing and never fire: promtool cannot tell, since its tests feed the same wrong
names as synthetic series. The defined metrics are those registered in
prometheus_client's registry once every module of every service and library is
imported (no process is started: metrics are module-level).
"""

from __future__ import annotations

import importlib
import json
import pkgutil
import re
from collections.abc import Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import REGISTRY

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "turnstile-rules.yml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "turnstile-rules.test.yml"
DASHBOARD = ROOT / "deploy" / "grafana" / "turnstile-dashboard.json"
OPERATIONS = ROOT / "docs" / "operations.md"

#: Every package whose modules may define metrics.
PACKAGES = (
    "turnstile_platform",
    "turnstile_clientkeys",
    "turnstile_admission",
    "turnstile_substrate",
    "turnstile_affinity",
)
#: Labels Prometheus adds to every scraped series (``le``: a histogram's buckets,
#: registered with the ``_bucket`` sample, so already among its labels).
TARGET_LABELS = frozenset({"job", "instance"})

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
_NAME = re.compile(r"(?<![A-Za-z0-9_:])turnstile_[A-Za-z0-9_]+")
_SELECTOR = re.compile(r"(?<![A-Za-z0-9_:])(turnstile_[A-Za-z0-9_]+)\s*\{([^}]*)\}")
_MATCHER = re.compile(r"\s*([A-Za-z_][A-Za-z0-9_]*)\s*(?:=~|!~|!=|=)")
_GROUPING = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


@cache
def _collectors() -> list[tuple[str, str, frozenset[str]]]:
    """(family name, type, label names) of every turnstile metric defined."""
    for package in PACKAGES:
        root = importlib.import_module(package)
        for module in pkgutil.walk_packages(root.__path__, f"{package}."):
            if module.name.rsplit(".", 1)[-1] != "__main__":
                importlib.import_module(module.name)
    found = []
    # The registry keeps its collectors privately; each metric object knows its
    # label names, which a family without samples yet does not show.
    for collector in list(REGISTRY._collector_to_names):
        for family in collector.collect():
            if family.name.startswith("turnstile_"):
                labels = frozenset(getattr(collector, "_labelnames", ()))
                found.append((family.name, family.type, labels))
    return found


@cache
def defined() -> dict[str, frozenset[str]]:
    """Sample name (``_total``, ``_bucket``… included) → its label names."""
    samples: dict[str, frozenset[str]] = {}
    for name, kind, labels in _collectors():
        for suffix in _SUFFIXES.get(kind, ("",)):
            samples[name + suffix] = labels | ({"le"} if suffix == "_bucket" else set())
    return samples


_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}


def _rules() -> list[dict[str, Any]]:
    return [
        rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]
    ]


def expressions() -> Iterator[tuple[str, str]]:
    """(where, PromQL) of every rule, every promtool test series and every panel."""
    for rule in _rules():
        yield rule.get("alert") or rule["record"], rule["expr"]
    for number, test in enumerate(yaml.safe_load(RULE_TESTS.read_text())["tests"]):
        for series in test.get("input_series", []):
            yield f"rule test {number} input", series["series"]
        for case in test.get("promql_expr_test", []):
            yield f"rule test {number} expr", case["expr"]
    for panel in json.loads(DASHBOARD.read_text())["panels"]:
        for target in panel["targets"]:
            yield f"panel {panel['title']!r}", target["expr"]


def _uses(expr: str) -> tuple[set[str], list[tuple[str, set[str]]], set[str]]:
    """Metric names, (metric, matcher labels) per selector, and grouping labels."""
    bare = _STRING.sub('""', expr)  # label values never read as names
    selectors = [
        (name, {m.group(1) for m in _MATCHER.finditer(body)})
        for name, body in _SELECTOR.findall(bare)
    ]
    grouping = {
        label.strip()
        for group in _GROUPING.findall(bare)
        for label in group.split(",")
        if label.strip()
    }
    return set(_NAME.findall(bare)), selectors, grouping


CASES = list(expressions())


@pytest.mark.parametrize(("where", "expr"), CASES, ids=[where for where, _ in CASES])
def test_every_metric_a_rule_test_or_panel_names_is_defined_with_those_labels(
    where: str, expr: str
) -> None:
    metrics = defined()
    names, selectors, grouping = _uses(expr)
    unknown = names - metrics.keys()
    assert not unknown, f"{where} names metrics no module defines: {sorted(unknown)}"
    for name, labels in selectors:
        extra = labels - metrics[name] - TARGET_LABELS - {"__name__"}
        assert not extra, f"{where}: {name} has no labels {sorted(extra)}"
    if names and "turnstile:" not in expr:
        available = set().union(*(metrics[name] for name in names)) | TARGET_LABELS
        assert grouping <= available, f"{where} groups by labels it has not: {grouping - available}"


def test_the_checks_see_the_metrics_of_every_service() -> None:
    """The import walk found each service's metrics (else the check above is vacuous)."""
    names = defined()
    for sample in (
        "turnstile_grpc_server_handled_total",
        "turnstile_admission_pending_expired_total",
        "turnstile_substrate_live_counts_current",
        "turnstile_affinity_relay_streams",
        "turnstile_leader_is_leader",
        "turnstile_dependency_breaker_state",
    ):
        assert sample in names, sample
    assert names["turnstile_admission_decision_seconds_bucket"] == {"decision", "le"}


def test_the_check_catches_a_metric_no_module_defines() -> None:
    names, selectors, grouping = _uses(
        'sum by (key) (rate(turnstile_admission_recounts_total{reason="x"}[5m]))'
    )
    assert names == {"turnstile_admission_recounts_total"}
    assert selectors == [("turnstile_admission_recounts_total", {"reason"})]
    assert grouping == {"key"}
    assert "turnstile_admission_recounts_total" not in defined()


def test_every_defined_metric_is_documented() -> None:
    """The metrics table of docs/operations.md names counters with ``_total``, as
    they are scraped, and other metrics by their family name."""
    documented = set(re.findall(r"^\| `(turnstile_[a-z0-9_]+)`", OPERATIONS.read_text(), re.M))
    expected = {name + ("_total" if kind == "counter" else "") for name, kind, _ in _collectors()}
    assert expected <= documented, sorted(expected - documented)
