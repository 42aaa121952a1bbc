"""The fairness index of the last minute (SPEC Q1): weighted max-min fair shares
and Jain's index. The counts behind it are tested with the queue's scripts
(test_admission_queue_lua.py), the gauge through Admit (test_admission_queue.py)."""

from __future__ import annotations

import math

import pytest

from turnstile_admission.fairness import jain_index, level_indexes, max_min_shares


def test_max_min_gives_a_small_demand_all_it_asks_and_splits_the_rest_by_weight() -> None:
    shares = max_min_shares({"light": 2, "a": 100, "b": 100}, {"b": 3}, capacity=42)
    assert shares == {"light": 2, "a": 10, "b": 30}
    # Enough for everyone: each gets its demand, nobody more.
    assert max_min_shares({"a": 1, "b": 2}, {}, capacity=10) == {"a": 1, "b": 2}


def test_jain_is_one_when_equal_and_one_over_n_when_one_has_all() -> None:
    assert jain_index([0.5, 0.5, 0.5]) == pytest.approx(1.0)
    assert jain_index([1.0, 0.0, 0.0, 0.0]) == pytest.approx(0.25)
    assert math.isnan(jain_index([]))


def test_a_starved_key_lowers_its_levels_index_and_levels_are_scored_apart() -> None:
    fields = [
        ("d:batch:heavy", "50"),
        ("g:batch:heavy", "40"),
        ("w:batch:heavy", "1"),
        ("d:batch:light", "40"),
        ("g:batch:light", "0"),
        ("w:batch:light", "1"),
        # Another level with far fewer grants is no unfairness of its own.
        ("d:platform:p", "2"),
        ("g:platform:p", "2"),
    ]
    indexes = level_indexes(fields)
    assert indexes["batch"] == pytest.approx(0.5)  # fair: 20 each; got 40 and 0
    assert indexes["platform"] == pytest.approx(1.0)
    # Weights count: 3:1 grants under weights 3:1 are fair.
    weighted = [("d:i:a", "100"), ("g:i:a", "30"), ("w:i:a", "3")]
    weighted += [("d:i:b", "100"), ("g:i:b", "10"), ("w:i:b", "1")]
    assert level_indexes(weighted)["i"] == pytest.approx(1.0)
