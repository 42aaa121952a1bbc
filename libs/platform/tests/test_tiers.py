"""The tier parser against the shared fixture every consumer loads (SPEC T2)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from turnstile_platform.tiers import (
    TierConfig,
    TierConfigError,
    UnknownTierError,
    parse_tiers,
)

FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "tiers.json"
CASES: dict[str, list[dict[str, Any]]] = json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", CASES["valid"], ids=lambda c: c["name"])
def test_every_valid_fixture_case_parses_to_its_declared_tiers_and_default(
    case: dict[str, Any],
) -> None:
    config = parse_tiers(case["tiers"], case["default_tier"], case.get("tier_settings"))
    assert list(config.declared) == case["declared"]
    assert config.default == case["default"]
    assert config.enabled == bool(case["declared"])
    if "settings" in case:
        assert {
            name: {"max_capacity": s.max_capacity, "shared_pool": s.shared_pool}
            for name, s in config.settings.items()
        } == case["settings"]


@pytest.mark.parametrize("case", CASES["invalid"], ids=lambda c: c["name"])
def test_every_invalid_fixture_case_is_refused_naming_the_setting(case: dict[str, Any]) -> None:
    with pytest.raises(TierConfigError) as raised:
        parse_tiers(case["tiers"], case["default_tier"], case.get("tier_settings"))
    assert raised.value.field == case["field"]
    assert case["error"] in str(raised.value)
    assert str(raised.value).startswith(f"{case['field']}: ")


def test_fixture_covers_both_outcomes() -> None:
    assert len(CASES["valid"]) >= 5
    assert len(CASES["invalid"]) >= 5


def test_empty_request_tier_means_the_default_tier() -> None:
    config = parse_tiers("container,microvm", "microvm")
    assert config.session_tier("") == "microvm"
    assert config.session_tier("container") == "container"


def test_undeclared_request_tier_is_refused_when_tiers_are_configured() -> None:
    with pytest.raises(UnknownTierError, match="declared: container, microvm"):
        parse_tiers("container,microvm").session_tier("gpu")


def test_any_request_tier_is_accepted_when_no_tiers_are_configured() -> None:
    config = TierConfig()
    assert not config.enabled
    assert config.session_tier("anything at all") == "anything at all"
    assert config.session_tier("") == ""


_NAME = st.from_regex(r"[A-Za-z0-9]([A-Za-z0-9._-]{0,20}[A-Za-z0-9])?", fullmatch=True)


@given(names=st.lists(_NAME, min_size=1, max_size=10, unique=True), pick=st.integers(0, 9))
def test_distinct_label_value_names_round_trip_in_order(names: list[str], pick: int) -> None:
    default = names[pick % len(names)]
    config = parse_tiers(" , ".join(names), default)
    assert config.declared == tuple(names)
    assert config.default == default


def test_a_tier_without_settings_takes_the_every_tier_entry_then_the_defaults() -> None:
    config = parse_tiers(
        "container,microvm,gpu",
        None,
        '{"*": {"max_capacity": 4}, "microvm": {"max_capacity": 1, "shared_pool": true}}',
    )
    assert config.settings_for("container").max_capacity == 4
    assert not config.settings_for("container").shared_pool
    assert config.settings_for("microvm").max_capacity == 1
    assert config.settings_for("microvm").shared_pool
    bare = parse_tiers("container")
    assert bare.settings_for("container").max_capacity == 1024
    assert not bare.settings_for("container").shared_pool
