"""The fair queue's fields of a limits document (SPEC Q1, Q2): a key's weight and
its priority level are validated like the other limits."""

from __future__ import annotations

import pytest

from turnstile_clientkeys.limits import ClusterLimits, Limits, LimitsError


def test_weight_and_level_are_read() -> None:
    limits = Limits.parse({"weight": 3, "level": "batch"})
    assert limits.weight == 3.0
    assert limits.level == "batch"
    assert Limits.parse(limits.as_dict()) == limits


@pytest.mark.parametrize(
    "doc",
    [{"weight": 0}, {"weight": -1}, {"weight": "3"}, {"level": "urgent"}, {"level": 1}],
)
def test_a_bad_weight_or_level_is_refused(doc: dict[str, object]) -> None:
    with pytest.raises(LimitsError):
        Limits.parse(doc)


def test_the_cluster_has_no_weight_or_level() -> None:
    with pytest.raises(LimitsError):
        ClusterLimits.parse({"level": "batch"})
