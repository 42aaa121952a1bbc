"""A key's limits document may carry ``shadow`` limits beside the enforced ones
(SPEC Q4): validated like the enforced ones, kept whole, never nested."""

from __future__ import annotations

import json
from typing import Any

import pytest

from turnstile_clientkeys.limits import ClusterLimits, Limits, LimitsError


def test_shadow_limits_are_parsed_and_kept() -> None:
    limits = Limits.parse({"cap": 10, "shadow": {"cap": 5, "rate": 0.5, "burst": 4}})
    assert limits.shadow == Limits(cap=5, rate=0.5, burst=4)
    assert json.loads(limits.to_json()) == {
        "cap": 10,
        "shadow": {"cap": 5, "rate": 0.5, "burst": 4},
    }


@pytest.mark.parametrize(
    "doc",
    [
        {"shadow": {"cap": -1}},
        {"shadow": {"shadow": {"cap": 1}}},  # never nested
        {"shadow": {"bogus": 1}},
        {"shadow": []},
        {"shadow": {"rate": 0}},
    ],
)
def test_invalid_shadow_limits_are_refused(doc: Any) -> None:
    with pytest.raises(LimitsError, match="shadow"):
        Limits.parse(doc)


def test_the_cluster_has_no_shadow_limits() -> None:
    with pytest.raises(LimitsError):
        ClusterLimits.parse({"rate": 10, "shadow": {"rate": 5}})
