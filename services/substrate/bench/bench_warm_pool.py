"""Warm-pool sizing benchmark (SPEC W1): static pools, the autosizer and an oracle, same traces.

    uv run python services/substrate/bench/bench_warm_pool.py [--runs 3] [--ready-s 2]
        [--static 1,2,3,4,5,6,8] [--plot docs/warm-pool-burst.svg]
        [--emulator autosize,static-4] [--speedup 10]

Each run draws four demand traces (seeded: run ``i`` uses seed ``i``) and replays every
one against every pool policy, so all figures of a run share its arrivals:

- ``steady``: Poisson claims at 1/s for 30 min;
- ``diurnal``: a daily cycle compressed into 30 min (two periods of 15 min), the rate
  between 0.1/s and 1.9/s;
- ``burst``: 0.5/s with two bursts at ×10 for a minute (at 10 and 20 min);
- ``idle_burst``: 0.5/s for 10 min, nothing for 15 min, a burst of 5/s for a minute, then
  0.5/s again.

Policies: ``static-N`` (the refill keeps N pods), ``autosize`` (the substrate's own
:class:`~turnstile_substrate.kubernetes.warm_sizing.PoolSizer` with the tier defaults:
``warm_min`` 0, ``warm_max`` 50, headroom 1.2) and ``oracle``: the smallest pool
schedule that hits every claim, computed offline from the trace. A claim needs a ready
pod; a pod claimed is replaced by a new one that takes the ready time, so at claim
``i`` the pool must hold ``1 + (claims in the ready time before it)`` pods; the oracle
holds, at each moment, the largest such need of the claims in the next ready time (it
grows early enough for its new pods to be ready) and nothing when no claim is near.

The pool is simulated, not run: a discrete-event model of the leader's refill loop
(:mod:`turnstile_substrate.kubernetes.warmpool`) on a simulated clock, so 30-minute
traces take a fraction of a second each. It follows the loop's rules: a pass runs on
every claim, every warm pod that becomes ready, and at least every 2 s
(``warm_pool_interval_s``); ``available`` counts pods still starting; the excess is
trimmed at once; claims take only ready (``Running``) pods and a miss is a cold create
that waits the ready time; the autosizer is fed every claim as demand and the measured
ready time of every pool pod (at the pass that sees it ready, as ``_observe`` does). A
pod's ready time is ``--ready-s`` times a log-normal factor (σ 0.15, clipped at ×1.5).
``--emulator autosize,static-4`` checks the model against the real thing: the first 15
minutes of the burst trace (one burst) replayed on the real Kubernetes substrate (warm
pool, reflector, sizer, claims through ``ensure_runtime``) against the API-server emulator
with its kubelet's start delay set to the ready time, ``--speedup`` (10) times faster than
the trace (the pool's clock, its refill interval and the start delay are scaled), beside
the model's figures for the same arrivals.

Per trace and policy: warm-hit ratio, p99 activation wait (a hit waits 0, a miss its
cold pod's ready time), idle warm pod-seconds (ready pods unclaimed, integrated), and for
bursts the hit ratio within each burst's first minute. Ratios are against ``static-2``
and against the oracle, within the same run; three runs give ranges. ``equal-cost
static``: the static pool's hit ratio at the autosizer's idle pod-seconds (linear
between the two static sizes around it), the issue's "static size that costs the same".

Output: a table per trace, then one JSON object (``{"warm_pool": {...}}``). ``--plot``
writes an SVG of the ``burst`` trace of run 0 (demand, the autosizer's target and pool
size, hits and misses).
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import heapq
import itertools
import json
import math
import os
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from turnstile_substrate.kubernetes.warm_sizing import PoolSizer, SizingPolicy

INTERVAL_S = 2.0  # warm_pool_interval_s (default)
BURST_WINDOW_S = 60.0


# Traces -------------------------------------------------------------------------------


@dataclass(frozen=True)
class Trace:
    name: str
    duration_s: float
    rate: Callable[[float], float]
    peak: float
    bursts: tuple[float, ...] = ()

    def arrivals(self, seed: int) -> list[float]:
        """Non-homogeneous Poisson arrivals (thinning)."""
        rng = random.Random(f"{self.name}:{seed}")
        out: list[float] = []
        now = 0.0
        while True:
            now += rng.expovariate(self.peak)
            if now >= self.duration_s:
                return out
            if rng.random() * self.peak <= self.rate(now):
                out.append(now)


def _burst(base: float, at: tuple[float, ...], factor: float) -> Callable[[float], float]:
    def rate(t: float) -> float:
        return base * factor if any(b <= t < b + BURST_WINDOW_S for b in at) else base

    return rate


def _idle_burst(t: float) -> float:
    if t < 600:
        return 0.5
    if t < 1500:
        return 0.0
    if t < 1560:
        return 5.0
    return 0.5


TRACES = (
    Trace("steady", 1800.0, lambda t: 1.0, 1.0),
    Trace("diurnal", 1800.0, lambda t: 1.0 - 0.9 * math.cos(2 * math.pi * t / 900.0), 1.9),
    Trace("burst", 1800.0, _burst(0.5, (600.0, 1200.0), 10.0), 5.0, (600.0, 1200.0)),
    Trace("idle_burst", 1800.0, _idle_burst, 5.0, (1500.0,)),
)


# Policies -----------------------------------------------------------------------------


class Policy:
    name = ""

    def target(self, now: float) -> int:
        raise NotImplementedError

    def demand(self, now: float) -> None:
        """A claim arrived (hit or miss)."""

    def ready(self, seconds: float) -> None:
        """A pool pod was seen ready ``seconds`` after its create."""

    def wakes(self) -> Iterator[float]:
        """Times at which the policy wants a pass of its own (the oracle's look-ahead)."""
        return iter(())


class Static(Policy):
    def __init__(self, size: int) -> None:
        self.size = size
        self.name = f"static-{size}"

    def target(self, now: float) -> int:
        return self.size


class Autosize(Policy):
    name = "autosize"

    def __init__(self) -> None:
        self.sizer = PoolSizer(SizingPolicy())

    def target(self, now: float) -> int:
        return self.sizer.size(now).target

    def demand(self, now: float) -> None:
        self.sizer.record_demand(now)

    def ready(self, seconds: float) -> None:
        self.sizer.record_ready(seconds)


class Oracle(Policy):
    """Holds, at ``t``, the largest need of the claims in ``(t, t + lead]``, where a claim's
    need is 1 + the claims within ``lead`` before it (their replacements are not ready)."""

    name = "oracle"

    def __init__(self, arrivals: list[float], lead_s: float) -> None:
        self.times = arrivals
        self.lead = lead_s
        self.need = [
            1 + i - bisect.bisect_left(arrivals, t - lead_s) for i, t in enumerate(arrivals)
        ]

    def target(self, now: float) -> int:
        lo = bisect.bisect_left(self.times, now)
        hi = bisect.bisect_right(self.times, now + self.lead)
        return max(self.need[lo:hi], default=0)

    def wakes(self) -> Iterator[float]:
        return (max(0.0, t - self.lead) for t in self.times)


# The refill loop, simulated ------------------------------------------------------------

CLAIM, READY, PASS = 0, 1, 2


@dataclass
class Pod:
    born: float
    ready_at: float
    ready: bool = False
    seen_ready: bool = False
    gone: bool = False


@dataclass
class Result:
    policy: str
    claims: int
    hits: int
    waits: list[float]
    idle_pod_s: float
    burst_hits: list[tuple[int, int]]
    series: list[tuple[float, float, int, int]] = field(default_factory=list)

    @property
    def hit_ratio(self) -> float:
        return self.hits / self.claims if self.claims else 1.0

    @property
    def p99_wait_s(self) -> float:
        ordered = sorted(self.waits)
        return ordered[min(len(ordered) - 1, math.ceil(0.99 * len(ordered)) - 1)]

    @property
    def burst_hit_ratio(self) -> float | None:
        total = sum(c for _, c in self.burst_hits)
        return sum(h for h, _ in self.burst_hits) / total if total else None


def simulate(
    trace: Trace,
    arrivals: list[float],
    policy: Policy,
    ready_s: float,
    seed: int,
    record: bool = False,
) -> Result:
    rng = random.Random(f"ready:{trace.name}:{seed}:{policy.name}")

    def ready_time() -> float:
        return ready_s * min(1.5, math.exp(rng.gauss(0.0, 0.15)))

    events: list[tuple[float, int, int]] = []
    seq = 0

    def push(at: float, kind: int) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(events, (at, seq, kind))

    for t in arrivals:
        push(t, CLAIM)
    for t in policy.wakes():
        push(t, PASS)
    tick = 0.0
    while tick < trace.duration_s:
        push(tick, PASS)
        tick += INTERVAL_S

    pods: list[Pod] = []
    pending_ready: dict[int, Pod] = {}
    hits = 0
    waits: list[float] = []
    idle = 0.0
    last = 0.0
    burst_hits = [[0, 0] for _ in trace.bursts]
    series: list[tuple[float, float, int, int]] = []
    ready_count = 0

    def refill(now: float) -> None:
        nonlocal ready_count, seq
        for pod in pods:
            if pod.ready and not pod.seen_ready:
                pod.seen_ready = True
                policy.ready(now - pod.born)
        size = policy.target(now)
        have = len(pods)
        if have < size:
            for _ in range(size - have):
                pod = Pod(born=now, ready_at=now + ready_time())
                pods.append(pod)
                seq += 1
                pending_ready[seq] = pod
                heapq.heappush(events, (pod.ready_at, seq, READY))
        elif have > size:
            # The refill trims any unclaimed pod; the newest first here (the least sunk cost).
            for pod in sorted(pods, key=lambda p: p.born)[size - have :]:
                pod.gone = True
                if pod.ready:
                    ready_count -= 1
            pods[:] = [p for p in pods if not p.gone]
        if record:
            series.append((now, 0.0, size, len(pods)))

    while events:
        now, key, kind = heapq.heappop(events)
        if now > trace.duration_s:
            break
        idle += ready_count * (now - last)
        last = now
        if kind == READY:
            pod = pending_ready.pop(key)
            if pod.gone:
                continue
            pod.ready = True
            ready_count += 1
        elif kind == CLAIM:
            policy.demand(now)
            ready = [p for p in pods if p.ready]
            hit = bool(ready)
            if hit:
                taken = min(ready, key=lambda p: p.ready_at)  # the oldest
                pods.remove(taken)
                ready_count -= 1
                hits += 1
                waits.append(0.0)
            else:
                waits.append(ready_time())  # a cold create
            for i, start in enumerate(trace.bursts):
                if start <= now < start + BURST_WINDOW_S:
                    burst_hits[i][0] += int(hit)
                    burst_hits[i][1] += 1
            if record:
                series.append((now, 1.0 if hit else -1.0, 0, 0))
        refill(now)
    idle += ready_count * (trace.duration_s - last)
    return Result(
        policy.name,
        len(arrivals),
        hits,
        waits,
        idle,
        [(h, c) for h, c in burst_hits],
        series,
    )


# Runs and the report ------------------------------------------------------------------


def run_once(seed: int, ready_s: float, statics: list[int]) -> dict[str, dict[str, Result]]:
    out: dict[str, dict[str, Result]] = {}
    for trace in TRACES:
        arrivals = trace.arrivals(seed)
        policies: list[Policy] = [Static(n) for n in statics]
        policies += [Autosize(), Oracle(arrivals, ready_s * 1.5)]
        out[trace.name] = {p.name: simulate(trace, arrivals, p, ready_s, seed) for p in policies}
    return out


def equal_cost_static(results: dict[str, Result], statics: list[int], idle: float) -> float:
    """The static pools' hit ratio at ``idle`` pod-seconds (linear between neighbours)."""
    points = sorted(
        (results[f"static-{n}"].idle_pod_s, results[f"static-{n}"].hit_ratio) for n in statics
    )
    if idle <= points[0][0]:
        return points[0][1] * idle / points[0][0] if points[0][0] else points[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(points):
        if x0 <= idle <= x1:
            return y0 + (y1 - y0) * (idle - x0) / (x1 - x0) if x1 > x0 else y1
    return points[-1][1]


def _range(values: list[float], fmt: str) -> str:
    lo, hi = min(values), max(values)
    return format(lo, fmt) if format(lo, fmt) == format(hi, fmt) else f"{lo:{fmt}}–{hi:{fmt}}"


def report(runs: list[dict[str, dict[str, Result]]], statics: list[int]) -> dict[str, object]:
    summary: dict[str, object] = {}
    reference = "static-2" if 2 in statics else f"static-{statics[0]}"
    for trace in TRACES:
        names = [f"static-{n}" for n in statics] + ["autosize", "oracle"]
        rows: dict[str, dict[str, list[float]]] = {}
        for name in names:
            row: dict[str, list[float]] = {
                "hit_ratio": [],
                "p99_wait_s": [],
                "idle_pod_s": [],
                "idle_vs_ref": [],
                "idle_vs_oracle": [],
                "burst_hit_ratio": [],
            }
            for run in runs:
                r, ref, oracle = (
                    run[trace.name][name],
                    run[trace.name][reference],
                    run[trace.name]["oracle"],
                )
                row["hit_ratio"].append(r.hit_ratio)
                row["p99_wait_s"].append(r.p99_wait_s)
                row["idle_pod_s"].append(r.idle_pod_s)
                row["idle_vs_ref"].append(
                    r.idle_pod_s / ref.idle_pod_s if ref.idle_pod_s else math.inf
                )
                row["idle_vs_oracle"].append(
                    r.idle_pod_s / oracle.idle_pod_s if oracle.idle_pod_s else math.inf
                )
                if r.burst_hit_ratio is not None:
                    row["burst_hit_ratio"].append(r.burst_hit_ratio)
            rows[name] = row
        equal = [
            equal_cost_static(run[trace.name], statics, run[trace.name]["autosize"].idle_pod_s)
            for run in runs
        ]
        claims = [run[trace.name]["oracle"].claims for run in runs]
        print(
            f"\n{trace.name} ({_range([float(c) for c in claims], '.0f')} claims, {len(runs)} runs)"
        )
        head = (
            f"{'policy':<11} {'hit ratio':>13} {'p99 wait s':>11} {'idle pod-s':>13} "
            f"{'idle ÷ ' + reference:>15} {'idle ÷ oracle':>14}"
        )
        if trace.bursts:
            head += f" {'burst 1st min hits':>19}"
        print(head)
        for name in names:
            row = rows[name]
            cells = [
                f"{name:<11}",
                f"{_range(row['hit_ratio'], '.3f'):>13}",
                f"{_range(row['p99_wait_s'], '.2f'):>11}",
                f"{_range(row['idle_pod_s'], '.0f'):>13}",
                f"{_range(row['idle_vs_ref'], '.2f'):>15}",
                f"{_range(row['idle_vs_oracle'], '.2f'):>14}",
            ]
            line = " ".join(cells)
            if trace.bursts:
                line += f" {_range(row['burst_hit_ratio'], '.3f'):>19}"
            print(line)
        beats = all(
            run[trace.name]["autosize"].hit_ratio >= e for run, e in zip(runs, equal, strict=True)
        )
        print(
            f"{'equal-cost static hit ratio':<28} {_range(equal, '.3f')}  (autosize beats it: "
            f"{beats})"
        )
        summary[trace.name] = {
            name: {k: [round(v, 4) for v in vals] for k, vals in rows[name].items()}
            for name in names
        }
        summary[trace.name]["equal_cost_static_hit_ratio"] = [round(e, 4) for e in equal]  # type: ignore[index]
    return summary


# The plot (plain SVG) -----------------------------------------------------------------


def _el(tag: str, text: str = "", **attrs: object) -> str:
    """One SVG element (``stroke_width`` → ``stroke-width``)."""
    body = " ".join(f'{k.replace("_", "-")}="{v}"' for k, v in attrs.items())
    return f"<{tag} {body}>{text}</{tag}>" if text else f"<{tag} {body}/>"


def plot(path: Path, seed: int, ready_s: float) -> None:
    """The burst trace under the autosizer: demand and warm hits (claims/s over 10 s), the
    target and the pool size (pods), and each miss as a red tick."""
    trace = next(t for t in TRACES if t.name == "burst")
    arrivals = trace.arrivals(seed)
    result = simulate(trace, arrivals, Autosize(), ready_s, seed, record=True)
    width, height, left, right, top, bottom = 900, 360, 50, 20, 50, 60
    plot_w, plot_h = width - left - right, height - top - bottom
    span = trace.duration_s
    sizes: list[tuple[float, int, int]] = []
    for t, kind, target, have in result.series:
        if kind == 0.0 and (not sizes or sizes[-1][1:] != (target, have)):
            sizes.append((t, target, have))
    bins = 10.0
    claims, hits = [0] * int(span / bins), [0] * int(span / bins)
    for t, kind, _, _ in result.series:
        if kind != 0.0:
            claims[min(len(claims) - 1, int(t / bins))] += 1
            hits[min(len(hits) - 1, int(t / bins))] += int(kind > 0)
    demand = [(i * bins + bins / 2, c / bins) for i, c in enumerate(claims)]
    served = [(i * bins + bins / 2, c / bins) for i, c in enumerate(hits)]
    top_value = max(max(d for _, d in demand), max(max(s, h) for _, s, h in sizes)) * 1.1

    def x(t: float) -> str:
        return f"{left + plot_w * t / span:.1f}"

    def y(v: float) -> str:
        return f"{top + plot_h * (1 - v / top_value):.1f}"

    def line(points: list[tuple[float, float]], colour: str, step: bool = False) -> str:
        coords: list[str] = []
        for i, (t, v) in enumerate(points):
            if step and i:
                coords.append(f"{x(t)},{y(points[i - 1][1])}")
            coords.append(f"{x(t)},{y(v)}")
        return _el(
            "polyline", fill="none", stroke=colour, stroke_width=1.5, points=" ".join(coords)
        )

    title = (
        f"Warm pool, burst trace (x10 for a minute at 10 and 20 min), ready time {ready_s:g} s, "
        "autosizer (SPEC W1)"
    )
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
        _el("rect", width=width, height=height, fill="white"),
        _el("text", title, x=left, y=18, font_size=14),
    ]
    for v in range(0, int(top_value) + 1, max(1, int(top_value // 6))):
        parts.append(_el("line", x1=left, x2=width - right, y1=y(v), y2=y(v), stroke="#eee"))
        parts.append(_el("text", str(v), x=left - 8, y=f"{float(y(v)) + 4:.1f}", text_anchor="end"))
    for minute in range(0, int(span / 60) + 1, 5):
        label = f"{minute} min"
        parts.append(
            _el("text", label, x=x(minute * 60), y=top + plot_h + 16, text_anchor="middle")
        )
    parts.append(line(demand, "#1f77b4"))
    parts.append(line(served, "#9467bd"))
    parts.append(line([(t, s) for t, s, _ in sizes], "#ff7f0e", step=True))
    parts.append(line([(t, h) for t, _, h in sizes], "#2ca02c", step=True))
    tick_y = top + plot_h + 24
    for t, kind, _, _ in result.series:
        if kind < 0:
            parts.append(_el("line", x1=x(t), x2=x(t), y1=tick_y, y2=tick_y + 8, stroke="#d62728"))
    legend = [
        ("#1f77b4", "demand, claims/s"),
        ("#9467bd", "warm hits/s"),
        ("#ff7f0e", "target, pods"),
        ("#2ca02c", "pool size (ready + starting)"),
    ]
    for i, (colour, text) in enumerate(legend):
        lx = left + 10 + i * 200
        parts.append(_el("line", x1=lx, x2=lx + 20, y1=36, y2=36, stroke=colour, stroke_width=2))
        parts.append(_el("text", text, x=lx + 26, y=40))
    caption = (
        f"red ticks: misses (cold creates); hit ratio {result.hit_ratio:.3f}, idle "
        f"{result.idle_pod_s:.0f} warm pod-seconds; 10 s bins; made by bench_warm_pool.py --plot"
    )
    parts.append(_el("text", caption, x=left, y=height - 8))
    parts.append("</svg>")
    path.write_text("\n".join(parts) + "\n", encoding="utf-8")
    print(f"wrote {path}")


# The cross-check on the API-server emulator ---------------------------------------------


async def _emulate(
    trace: Trace, arrivals: list[float], policy: str, ready_s: float, speedup: float
) -> tuple[float, float, float]:
    """Replay ``arrivals`` against the real Kubernetes substrate (warm pool, reflector,
    sizer) on the API-server emulator, ``speedup`` times faster than the trace: the pool's
    clock and the kubelet's start delay are scaled, so figures are in trace seconds.
    Returns (warm-hit ratio, idle warm pod-seconds, the ready time the sizer measured)."""
    from prometheus_client import REGISTRY

    from turnstile_clientkeys import KeySet, Resolver
    from turnstile_substrate.kubernetes import KubernetesSettings, KubernetesSubstrate
    from turnstile_substrate.kubernetes.tier_runtime import TierRuntime
    from turnstile_substrate.runtime import CreateKind, RuntimeSpec
    from turnstile_testing.kube_emulator import KubeEmulator
    from turnstile_testing.kube_emulator.kubelet import KubeletConfig

    tier = f"bench-{policy}"
    if policy == "autosize":
        runtime = TierRuntime(warm_autosize=True)
    else:
        runtime = TierRuntime(warm_pool_size=int(policy.removeprefix("static-")))

    def idle() -> float:
        name = "turnstile_substrate_warm_idle_pod_seconds_total"
        return REGISTRY.get_sample_value(name, {"tier": tier}) or 0.0

    async def no_gate() -> None:
        return None

    kubelet = KubeletConfig(start_delay=ready_s / speedup, stop_delay=0.01)
    async with KubeEmulator(bookmark_interval=0.05, kubelet=kubelet) as kube:
        settings = KubernetesSettings(
            api_host=kube.url,
            namespace="sandboxes",
            warm_pool_interval_s=INTERVAL_S / speedup,
            warm_require_running=True,
            tier_runtimes={tier: runtime},
        )
        sub = KubernetesSubstrate(settings, Resolver(KeySet(version=1, allowlist=frozenset())))
        await sub.start()
        try:
            await sub.wait_synced(10)
            assert sub.pool is not None
            start = time.monotonic()
            sub.pool._clock = lambda: (time.monotonic() - start) * speedup
            idle0 = idle()
            hits = 0

            async def claim(index: int, at: float) -> None:
                nonlocal hits
                await asyncio.sleep(max(0.0, start + at / speedup - time.monotonic()))
                spec = RuntimeSpec(sandbox_id=f"s{index}", tier=tier, client_label=None)
                made = await sub.ensure_runtime(spec, sub.plan(spec), no_gate)
                hits += int(made.kind is CreateKind.WARM)

            await asyncio.gather(*(claim(i, t) for i, t in enumerate(arrivals)))
            await asyncio.sleep(max(0.0, start + trace.duration_s / speedup - time.monotonic()))
            sizer = sub.pool.sizer(tier)
            ready = sizer.ready_s if sizer is not None else float("nan")
            return hits / len(arrivals), idle() - idle0, ready
        finally:
            await sub.close()


def cross_check(seed: int, ready_s: float, speedup: float, policies: list[str]) -> None:
    """The model and the real loop on the emulator, same arrivals: the first 15 minutes of
    the burst trace (one burst)."""
    base = next(t for t in TRACES if t.name == "burst")
    trace = Trace("burst-15min", 900.0, base.rate, base.peak, (600.0,))
    arrivals = [t for t in base.arrivals(seed) if t < trace.duration_s]
    print(f"\ncross-check: {trace.name}, {len(arrivals)} claims, emulator {speedup:g}x fast")
    print(
        f"{'policy':<11} {'model hits':>10} {'emulator hits':>14} {'model idle':>11} "
        f"{'emul. idle':>11} {'measured ready':>15}"
    )
    for name in policies:
        model_policy: Policy = Autosize() if name == "autosize" else Static(int(name[7:]))
        model = simulate(trace, arrivals, model_policy, ready_s, seed)
        ratio, idle, measured = asyncio.run(_emulate(trace, arrivals, name, ready_s, speedup))
        print(
            f"{name:<11} {model.hit_ratio:>10.3f} {ratio:>14.3f} {model.idle_pod_s:>11.0f} "
            f"{idle:>11.0f} {measured:>15.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--ready-s", type=float, default=2.0)
    parser.add_argument("--static", default="1,2,3,4,5,6,8", help="static pool sizes to compare")
    parser.add_argument("--plot", type=Path, help="write the burst trace's SVG here")
    parser.add_argument(
        "--emulator",
        metavar="POLICIES",
        help="also replay 15 min of the burst trace on the emulator (e.g. autosize,static-4)",
    )
    parser.add_argument(
        "--speedup", type=float, default=10.0, help="the emulator run's time compression"
    )
    args = parser.parse_args()
    statics = sorted({int(n) for n in args.static.split(",")})
    runs = [run_once(seed, args.ready_s, statics) for seed in range(args.runs)]
    summary = report(runs, statics)
    if args.plot is not None:
        plot(args.plot, 0, args.ready_s)
    if args.emulator:
        cross_check(0, args.ready_s, args.speedup, args.emulator.split(","))
    print(
        json.dumps(
            {
                "warm_pool": {
                    "ready_s": args.ready_s,
                    "runs": args.runs,
                    "load": list(os.getloadavg()),
                    "traces": summary,
                }
            }
        )
    )
    sys.stdout.flush()


if __name__ == "__main__":
    main()
