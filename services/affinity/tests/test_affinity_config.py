"""Settings, the shared tier fixture and retry hints (SPEC T2, T3, T9)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from turnstile_affinity.retry import pending_retry_after_s
from turnstile_affinity.settings import AffinitySettings


@pytest.fixture(autouse=True)
def _no_attestation(monkeypatch: pytest.MonkeyPatch) -> None:
    """These tests are about tiers and timings, not attestation (tested below)."""
    monkeypatch.setenv("TURNSTILE_WORKER_ATTESTATION", "off")


FIXTURE = Path(__file__).resolve().parents[3] / "tests" / "fixtures" / "tiers.json"
CASES: dict[str, list[dict[str, Any]]] = json.loads(FIXTURE.read_text(encoding="utf-8"))


@pytest.mark.parametrize("case", CASES["valid"], ids=lambda c: c["name"])
def test_the_service_accepts_every_valid_tier_fixture_case(case: dict[str, Any]) -> None:
    settings = AffinitySettings(
        tiers=case["tiers"],
        default_tier=case["default_tier"],
        tier_settings=case.get("tier_settings"),
    )
    assert list(settings.tier_config.declared) == case["declared"]
    assert settings.tier_config.default == case["default"]


@pytest.mark.parametrize("case", CASES["invalid"], ids=lambda c: c["name"])
def test_the_service_refuses_to_start_on_every_invalid_tier_fixture_case(
    case: dict[str, Any],
) -> None:
    with pytest.raises(ValidationError) as raised:
        AffinitySettings(
            tiers=case["tiers"],
            default_tier=case["default_tier"],
            tier_settings=case.get("tier_settings"),
        )
    message = str(raised.value)
    assert f"TURNSTILE_{case['field'].upper()}" in message
    assert case["error"] in message


def test_tiers_come_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TURNSTILE_TIERS", "container,microvm")
    monkeypatch.setenv("TURNSTILE_DEFAULT_TIER", "microvm")
    config = AffinitySettings().tier_config
    assert (config.declared, config.default) == (("container", "microvm"), "microvm")


def test_defaults_are_the_specified_ttl_and_grace() -> None:
    settings = AffinitySettings()
    assert settings.affinity_ttl_s == 86_400
    assert settings.grace_s == 60
    assert not settings.tier_config.enabled


def test_attestation_is_enforced_by_default_and_then_needs_public_keys(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv("TURNSTILE_WORKER_ATTESTATION")
    with pytest.raises(ValidationError, match="TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE"):
        AffinitySettings()
    keys = tmp_path / "public.pem"
    settings = AffinitySettings(worker_credential_public_keys_file=keys)
    assert settings.worker_attestation == "enforce"
    assert AffinitySettings(worker_attestation="off").worker_credential_public_keys_file is None


def test_presence_must_outlive_the_heartbeat_interval() -> None:
    with pytest.raises(ValidationError, match="TURNSTILE_PRESENCE_TTL_S"):
        AffinitySettings(heartbeat_interval_s=5, presence_ttl_s=5)


@pytest.mark.parametrize(
    ("remaining_ms", "expected"),
    [(0, 1), (1, 1), (999, 1), (1000, 1), (1001, 2), (2500, 3), (9001, 10), (60_000, 10)],
)
def test_pending_retry_hint_table(remaining_ms: float, expected: float) -> None:
    assert pending_retry_after_s(remaining_ms, default_s=5) == expected


@pytest.mark.parametrize("remaining_ms", [math.nan, math.inf, -math.inf])
def test_pending_retry_hint_falls_back_to_the_default_when_not_finite(
    remaining_ms: float,
) -> None:
    assert pending_retry_after_s(remaining_ms, default_s=7.5) == 7.5


@given(st.floats(allow_nan=True, allow_infinity=True), st.floats(0.1, 100))
def test_pending_retry_hint_is_the_spec_formula(remaining_ms: float, default_s: float) -> None:
    hint = pending_retry_after_s(remaining_ms, default_s)
    if math.isfinite(remaining_ms):
        assert hint == min(10, max(1, math.ceil(remaining_ms / 1000)))
        assert 1 <= hint <= 10
    else:
        assert hint == default_s
