"""The warm-pool sizing rule (SPEC W1), on a hand-driven clock."""

from __future__ import annotations

import itertools
import math
import random

from turnstile_substrate.kubernetes.warm_sizing import PoolSizer, SizingPolicy


def _steady(sizer: PoolSizer, rate: float, start: float, end: float, seed: int = 1) -> float:
    """Poisson arrivals at ``rate`` from ``start`` to ``end``; returns the last time."""
    rng = random.Random(seed)
    now = start
    while True:
        now += rng.expovariate(rate)
        if now >= end:
            return end
        sizer.record_demand(now)


def test_target_covers_demand_over_ready_time_with_headroom() -> None:
    policy = SizingPolicy(min_size=0, max_size=100, headroom=1.2, z=2.0)
    sizer = PoolSizer(policy)
    sizer.record_ready(2.0)
    now = _steady(sizer, 5.0, 0.0, 600.0)
    sizing = sizer.size(now)
    assert 4.0 < sizing.forecast < 6.5
    mean = sizing.forecast * 2.0
    assert sizing.target == math.ceil(1.2 * mean + 2.0 * math.sqrt(mean) - 1e-9)
    assert 16 <= sizing.target <= 22


def test_unseen_ready_time_uses_the_default_then_follows_measurements() -> None:
    sizer = PoolSizer(SizingPolicy(default_ready_s=7.0))
    assert sizer.ready_s == 7.0
    sizer.record_ready(3.0)
    assert sizer.ready_s == 3.0
    sizer.record_ready(7.0)
    assert sizer.ready_s == 4.0
    sizer.record_ready(float("nan"))
    sizer.record_ready(-1.0)
    assert sizer.ready_s == 4.0


def test_bounded_by_the_tier_minimum_and_maximum() -> None:
    sizer = PoolSizer(SizingPolicy(min_size=3, max_size=10))
    assert sizer.size(0.0).target == 3
    _steady(sizer, 100.0, 0.0, 60.0)
    assert sizer.size(60.0).target == 10


def test_a_burst_grows_the_pool_within_seconds() -> None:
    sizer = PoolSizer(SizingPolicy(max_size=200))
    sizer.record_ready(2.0)
    _steady(sizer, 1.0, 0.0, 300.0)
    before = sizer.size(300.0).target
    _steady(sizer, 10.0, 300.0, 303.0, seed=2)
    after = sizer.size(303.0).target
    assert after >= 2 * before


def test_shrinks_only_after_the_hold_and_one_step_at_a_time() -> None:
    policy = SizingPolicy(shrink_hold_s=60.0, shrink_step_s=10.0, idle_after_s=10_000.0)
    sizer = PoolSizer(policy)
    sizer.record_ready(2.0)
    _steady(sizer, 10.0, 0.0, 120.0)
    high = sizer.size(120.0).target
    # demand drops to a trickle: the raw target falls, the pool holds
    sizer.record_demand(121.0)
    targets = []
    for second in range(121, 300):
        if second % 5 == 0:
            sizer.record_demand(float(second))
        targets.append(sizer.size(float(second)).target)
    assert targets[30] == high  # within the hold
    drops = [a - b for a, b in itertools.pairwise(targets) if a != b]
    assert drops
    assert all(drop == 1 for drop in drops)
    assert targets[-1] < high


def test_falls_to_the_minimum_when_demand_stops() -> None:
    sizer = PoolSizer(SizingPolicy(min_size=1, idle_after_s=120.0))
    _steady(sizer, 5.0, 0.0, 100.0)
    assert sizer.size(100.0).target > 1
    assert sizer.size(219.0).target > 1
    assert sizer.size(221.0).target == 1


def test_no_demand_ever_keeps_the_minimum() -> None:
    sizer = PoolSizer(SizingPolicy(min_size=2))
    assert [sizer.size(float(t)).target for t in range(5)] == [2] * 5
