"""The Grafana dashboard's every query returns series from a real Prometheus
scraping a running local stack (SPEC X3).

``turnstilectl up`` starts the stack and, since Prometheus is installed, a
Prometheus of its own scraping the three metrics endpoints every second with
``deploy/prometheus/turnstile-rules.yml``. The test sends the traffic the
panels show (activations, a placement, admissions with refusals), then runs
each panel's query, with Grafana's ``$__rate_interval`` replaced, through
Prometheus' HTTP API until it returns series.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_clientkeys.limits import DEFAULT, ClusterLimits, LimitsStore
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    affinity_pb2,
    affinity_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_testing.eventually import eventually
from turnstile_testing.processes import free_port
from turnstile_testing.stack import RunningStack, run_stack

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "turnstile-dashboard.json"
GRAFANA_VARIABLES = {"$__rate_interval": "1m", "$__interval": "15s", "$__range": "5m"}

pytestmark = pytest.mark.skipif(
    shutil.which("prometheus") is None,
    reason="Prometheus is not installed (Debian's prometheus package; ./scripts/test installs it)",
)


#: Panels whose description starts so show what only the Kubernetes substrate exports: the
#: local stack (Direct) gives them no series, so only their queries are checked.
KUBERNETES_ONLY = "Kubernetes substrate only"


def queries(kubernetes_only: bool = False) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every target of every panel (``kubernetes_only``: of the
    panels only the Kubernetes substrate feeds; else of the others)."""
    dashboard = json.loads(DASHBOARD.read_text())
    found = []
    for panel in dashboard["panels"]:
        if panel.get("description", "").startswith(KUBERNETES_ONLY) != kubernetes_only:
            continue
        for target in panel["targets"]:
            expr = target["expr"]
            for variable, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(variable, value)
            found.append((panel["title"], expr))
    return found


def _query(prometheus_port: int, expr: str) -> list[Any]:
    url = f"http://127.0.0.1:{prometheus_port}/api/v1/query?" + urllib.parse.urlencode(
        {"query": expr}
    )
    with urllib.request.urlopen(url, timeout=5) as answer:
        body = json.load(answer)
    assert body["status"] == "success", body
    result: list[Any] = body["data"]["result"]
    return result


async def _shadow_limit(
    admit: admission_pb2_grpc.AdmissionServiceAsyncStub, redis_url: str, redis_prefix: str
) -> None:
    """A shadow concurrency limit of 2 on every key (SPEC Q4), once admission uses it."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await LimitsStore(client, redis_prefix).put(DEFAULT, {"shadow": {"concurrency": 2}})
    finally:
        await client.aclose()

    async def reported() -> bool:
        answer = await admit.Admit(
            admission_pb2.AdmitRequest(
                sandbox_id="sb-dash-shadow",
                client=common_pb2.ActivationClient(client_id="someone-else"),
                kind=common_pb2.ACTIVATION_KIND_RESUME,
                dry_run=True,
            ),
            timeout=10,
        )
        return bool(answer.shadow_verdicts)

    await eventually(
        reported, timeout_s=60, interval_s=0.2, what="admission reports the shadow limit"
    )


async def _queued(
    admit: admission_pb2_grpc.AdmissionServiceAsyncStub, redis_url: str, redis_prefix: str
) -> None:
    """Admissions that wait in the fair queue (SPEC Q1): the cluster bucket at 20
    tokens a second with a burst of 1, and eight calls at once with a budget."""
    client = aioredis.Redis.from_url(redis_url)
    try:
        await LimitsStore(client, redis_prefix).set_cluster(ClusterLimits(rate=20, burst=1))
    finally:
        await client.aclose()

    async def one(i: int) -> None:
        request = admission_pb2.AdmitRequest(
            sandbox_id=f"sb-dash-queued-{i}",
            client=common_pb2.ActivationClient(client_id="acme"),
            kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
        )
        request.wait_budget.FromSeconds(10)
        answer = await admit.Admit(request, timeout=20)
        assert answer.decision == admission_pb2.DECISION_ADMITTED, answer.message

    await asyncio.gather(*(one(i) for i in range(8)))


async def _traffic(stack: RunningStack, redis_url: str, redis_prefix: str) -> None:
    """What the panels show: activations, a placement, a Prepare, admissions and
    refusals, what a shadow limit would have refused, and waiters of the fair queue."""
    admission, substrate, affinity = stack.addresses
    async with stack.channel(substrate) as channel:
        stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
        await stub.Activate(
            substrate_pb2.ActivateRequest(
                sandbox_id="sb-dash-1",
                client=common_pb2.ActivationClient(client_id="acme"),
                tier="container",
            ),
            timeout=30,
        )
    async with stack.channel(affinity) as channel:
        place = affinity_pb2_grpc.AffinityServiceStub(channel)
        for _ in range(60):  # until the sandbox's worker has attached
            try:
                placed = await place.Place(
                    affinity_pb2.PlaceRequest(
                        client_id="acme", session_id="dash-1", tier="container"
                    ),
                    timeout=10,
                )
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.5)
                continue
            await place.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(
                    sandbox_id=placed.sandbox_id, lease_id=placed.lease_id
                ),
                timeout=10,
            )
            break
        # The gateway's Prepare of the session: its sandbox runs, nothing to do (SPEC W2).
        await place.Prepare(
            affinity_pb2.PrepareRequest(client_id="acme", session_id="dash-1"), timeout=10
        )
    async with stack.channel(admission) as channel:
        admit = admission_pb2_grpc.AdmissionServiceStub(channel)
        await _shadow_limit(admit, redis_url, redis_prefix)
        await _queued(admit, redis_url, redis_prefix)
        # The shared key allows 10 activations in flight: the rest are refused
        # (and past 2, the shadow limit would have refused them).
        for i in range(14):
            await admit.Admit(
                admission_pb2.AdmitRequest(
                    sandbox_id=f"sb-dash-hold-{i}",
                    client=common_pb2.ActivationClient(client_id="someone-else"),
                    kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
                ),
                timeout=10,
            )


@pytest.mark.timeout(300)
async def test_every_dashboard_query_returns_series_from_the_local_stack(
    tmp_path: Path, redis_url: str, redis_prefix: str, database_url: str
) -> None:
    metrics = (free_port(), free_port(), free_port())
    prometheus_port = free_port()
    with run_stack(
        tmp_path,
        redis_url=redis_url,
        redis_prefix=redis_prefix,
        database_url=database_url,
        metrics_ports=metrics,
        prometheus_port=prometheus_port,
        # A cap without a count, so the fail-open panel has its (by-design) series.
        # 64 seats a replica, so one burst shows the fair-share refusals panel.
        extra_env={
            "TURNSTILE_DIRECT_LIVE_COUNTS": "unsupported",
            "TURNSTILE_MAX_CONCURRENT_RPCS": "64",
        },
    ) as stack:
        await stack.wait_serving()
        assert f"http://127.0.0.1:{prometheus_port}" in stack.output()  # the banner says where
        await _traffic(stack, redis_url, redis_prefix)
        # The fair-share refusals panel has series only once a flow is refused its
        # share (SPEC N1), which this traffic cannot cause deterministically; its
        # metric name is checked against the code by tests/deploy/test_metric_names.py
        # and the refusal itself by libs/platform/tests/test_fair_share.py.
        empty = {q for q in queries() if "turnstile_fair_share_refused_total" not in q[1]}
        # Scrapes every second, rules evaluated every second: poll until each
        # query has series (rates need two scrapes after the traffic).
        for _ in range(120):
            for title, expr in sorted(empty):
                if await asyncio.to_thread(_query, prometheus_port, expr):
                    empty.discard((title, expr))
            if not empty:
                break
            await asyncio.sleep(0.5)
        assert not empty, f"panels without series: {sorted(empty)}\n{stack.output()[-3000:]}"
        for _, expr in queries(kubernetes_only=True):
            _query(prometheus_port, expr)  # a valid query (series come from a cluster)
    # The stack stops its Prometheus with it, as its own (not as a leftover).
    with pytest.raises(urllib.error.URLError):
        _query(prometheus_port, "up")
    assert "leftover" not in stack.output()
