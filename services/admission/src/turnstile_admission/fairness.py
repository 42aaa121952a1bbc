"""How fair the fair queue was over the last minute (SPEC Q1): Jain's index over
each key's admitted ÷ its weighted max-min fair share, per priority level.

The counts are the queue's own: ``enqueue.lua`` counts each join (the key's
demand) and ``tick.lua`` each grant, by level and key, in 10 s windows in Redis
(``count_fairness`` in ``_queue.lua``), so they cover every replica's waiters at
O(1) Redis work per join and grant. A key's fair share is what weighted max-min
fairness gives it of the level's grants in the minute (a key that asked for less
than an equal-weight part gets all it asked; the rest is split by weight among
the others), so a work-conserving queue that served each key its turn scores 1
and one that starved a key scores towards 1/n. Levels are scored apart: their
guaranteed shares (SPEC Q2) are not unfairness.

Where it runs: on every replica, a :class:`BackgroundTasks` job reading the same
counts (one script call per interval), so each replica exports the same
cluster-wide gauge and no leader is needed; aggregate it with ``max``.
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence

from turnstile_admission import metrics
from turnstile_admission.redis_store import AdmissionStore
from turnstile_platform.dependencies import DependencyOverloaded, DependencyUnavailable

log = logging.getLogger(__name__)


def max_min_shares(
    demand: Mapping[str, float], weight: Mapping[str, float], capacity: float
) -> dict[str, float]:
    """Weighted max-min fair shares of ``capacity`` among keys asking ``demand``:
    water-filling, a key never given more than it asked."""
    shares: dict[str, float] = {}
    left = {k: d for k, d in demand.items() if d > 0}
    remaining = capacity
    while left and remaining > 1e-12:
        total = sum(weight.get(k, 1.0) for k in left)
        unit = remaining / total
        sated = {k: d for k, d in left.items() if d <= unit * weight.get(k, 1.0)}
        if not sated:
            for k in left:
                shares[k] = unit * weight.get(k, 1.0)
            return shares
        for k, d in sated.items():
            shares[k] = d
            remaining -= d
            del left[k]
    return shares


def jain_index(values: Sequence[float]) -> float:
    """Jain's index (Σx)² ÷ (n Σx²): 1 when all are equal, 1/n when one has all."""
    squares = sum(v * v for v in values)
    if not values or squares == 0:
        return math.nan
    return sum(values) ** 2 / (len(values) * squares)


def level_indexes(fields: Iterable[tuple[str, str]]) -> dict[str, float]:
    """Each level's index from the counts ``fairness.lua`` returns (``d:``/``g:``/
    ``w:<level>:<key>``, summed over the windows): admitted ÷ max-min fair share
    of the level's grants, a key's demand being at least what it was granted
    (it may have joined before the minute)."""
    joined: dict[str, dict[str, float]] = defaultdict(dict)
    granted: dict[str, dict[str, float]] = defaultdict(dict)
    weights: dict[str, dict[str, float]] = defaultdict(dict)
    for name, value in fields:
        kind, _, rest = name.partition(":")
        level, _, key = rest.partition(":")
        if kind == "w":
            weights[level][key] = float(value)
        elif kind in ("d", "g"):
            counts = joined if kind == "d" else granted
            counts[level][key] = counts[level].get(key, 0.0) + float(value)
    indexes: dict[str, float] = {}
    for level, grants in granted.items():
        demand = {k: max(grants.get(k, 0.0), joined[level].get(k, 0.0)) for k in joined[level]}
        demand.update({k: max(g, demand.get(k, 0.0)) for k, g in grants.items()})
        fair = max_min_shares(demand, weights[level], sum(grants.values()))
        ratios = [grants.get(k, 0.0) / share for k, share in fair.items() if share > 0]
        indexes[level] = jain_index(ratios)
    return indexes


class FairnessGauge:
    """Sets ``turnstile_admission_queue_fairness{level}`` every ``interval_s``
    (every replica: see the module docstring); a level with no grant in the
    minute reports NaN (nothing to judge)."""

    def __init__(self, store: AdmissionStore, levels: Sequence[str], interval_s: float) -> None:
        self._store = store
        self._levels = tuple(levels)
        self._interval_s = interval_s

    async def update(self) -> None:
        """Read the last minute's counts once and set the gauge."""
        indexes = level_indexes(await self._store.fairness_counts())
        for level in self._levels:
            metrics.QUEUE_FAIRNESS.labels(level).set(indexes.get(level, math.nan))

    async def run(self) -> None:
        while True:
            try:
                await self.update()
            except (DependencyUnavailable, DependencyOverloaded) as error:
                log.warning("fair queue: fairness not read", extra={"error": str(error)})
            await asyncio.sleep(self._interval_s)
