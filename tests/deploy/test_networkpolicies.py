"""NetworkPolicies allow exactly the calls of the call graph, under a default deny.

Each expected call is checked on both sides (the caller's egress and the callee's
ingress) with a small evaluator of NetworkPolicy semantics (netpol.py); so is a
list of calls that must stay blocked. Pod labels come from the rendered
workloads, so relabelling a Deployment without its policies fails here. What this
does not prove: that the cluster's CNI enforces policies at all (Docker Desktop's
does not), or that the API server and managed data stores sit where the ipBlock
and selectors assume (docs/deploy.md).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from .manifests import SERVICES, Obj, of_kind, workloads
from .netpol import Endpoint, allowed, selecting

Built = Callable[[str], list[Obj]]

WORKER = Endpoint(
    "worker", {"app.kubernetes.io/name": "turnstile-worker"}, namespace="turnstile-sandboxes"
)
"""A sandbox pod as substrate labels it (the label the services must honour), in the
sandboxes' namespace (SPEC O4)."""

IMPOSTOR = Endpoint(
    "impostor", {"app.kubernetes.io/name": "turnstile-worker"}, namespace="platform"
)
"""A pod labelled like a sandbox pod in another namespace: the label alone opens nothing."""

SANDBOX_NEIGHBOUR = Endpoint("sandbox-neighbour", {"app": "x"}, namespace="turnstile-sandboxes")
"""An unlabelled pod in the sandboxes' namespace."""

API_SERVER = Endpoint("kube-apiserver", pod=False)
KUBE_DNS = Endpoint("kube-dns", {"k8s-app": "kube-dns"}, namespace="kube-system")
PROMETHEUS = Endpoint(
    "prometheus", {"app.kubernetes.io/name": "prometheus"}, namespace="monitoring"
)
API_CLIENT = Endpoint("api-client", {"turnstile.dev/api-client": "true"}, namespace="platform")
STRANGER = Endpoint("stranger", {"app": "something-else"}, namespace="platform")
NEIGHBOUR = Endpoint("neighbour", {"app": "something-else"})
"""An unlabelled pod in Turnstile's own namespace."""

COLLECTOR_PROD = Endpoint(
    "otel-collector", {"app.kubernetes.io/component": "otel-collector"}, namespace="observability"
)
REDIS = Endpoint("redis", {"app.kubernetes.io/name": "redis"})
POSTGRES = Endpoint("postgres", {"app.kubernetes.io/name": "postgresql"})

# (source, destination, port): the call graph plus telemetry, scraping and clients.
ALLOWED = [
    ("affinity", "substrate", 50052),  # Activate
    ("substrate", "admission", 50051),  # Admit / CommitHold / CancelHold
    ("admission", "redis", 6379),
    ("substrate", "redis", 6379),
    ("affinity", "redis", 6379),
    ("substrate", "postgres", 5432),
    ("migrate", "postgres", 5432),
    ("substrate", "kube-apiserver", 443),
    ("substrate", "kube-apiserver", 6443),
    ("worker", "affinity", 50053),  # relay Attach stream
    ("admission", "otel-collector", 4317),
    ("substrate", "otel-collector", 4317),
    ("affinity", "otel-collector", 4317),
    ("prometheus", "admission", 9091),
    ("prometheus", "substrate", 9092),
    ("prometheus", "affinity", 9093),
    ("api-client", "affinity", 50053),
    ("api-client", "substrate", 50052),
    ("api-client", "admission", 50051),
]

DENIED = [
    ("admission", "postgres", 5432),
    ("affinity", "postgres", 5432),
    ("affinity", "admission", 50051),
    ("admission", "affinity", 50053),
    ("substrate", "affinity", 50053),
    ("admission", "kube-apiserver", 443),
    ("affinity", "kube-apiserver", 443),
    ("worker", "kube-apiserver", 443),
    ("worker", "substrate", 50052),
    ("worker", "admission", 50051),
    ("worker", "redis", 6379),
    ("worker", "postgres", 5432),
    ("worker", "otel-collector", 4317),
    ("worker", "affinity", 8081),  # health port
    ("worker", "affinity", 9093),  # metrics
    ("worker", "neighbour", 8080),
    ("migrate", "redis", 6379),
    ("migrate", "kube-apiserver", 443),
    ("stranger", "affinity", 50053),
    ("stranger", "substrate", 50052),
    ("neighbour", "admission", 50051),
    ("neighbour", "redis", 6379),
    ("neighbour", "postgres", 5432),
    ("neighbour", "worker", 8080),
    ("affinity", "worker", 8080),
    ("impostor", "affinity", 50053),
    ("sandbox-neighbour", "affinity", 50053),
    ("sandbox-neighbour", "worker", 8080),
    ("worker", "sandbox-neighbour", 8080),
    ("prometheus", "substrate", 50052),
    ("api-client", "substrate", 9092),
]


def _endpoints(objects: list[Obj], collector: Endpoint) -> dict[str, Endpoint]:
    endpoints = {
        e.name: e
        for e in (
            WORKER,
            IMPOSTOR,
            SANDBOX_NEIGHBOUR,
            API_SERVER,
            KUBE_DNS,
            PROMETHEUS,
            API_CLIENT,
            STRANGER,
            NEIGHBOUR,
        )
    }
    endpoints |= {"redis": REDIS, "postgres": POSTGRES, "otel-collector": collector}
    for workload, template in workloads(objects):
        name = workload["metadata"]["name"].removeprefix("turnstile-")
        if name in (*SERVICES, "migrate"):
            endpoints[name] = Endpoint(name, template["metadata"]["labels"])
    return endpoints


def _graph(built: Built, name: str) -> tuple[list[Obj], dict[str, Endpoint]]:
    objects = built(name)
    if name == "dev":
        jaeger = next(
            w for w in of_kind(objects, "Deployment") if w["metadata"]["name"] == "jaeger"
        )
        collector = Endpoint("otel-collector", jaeger["spec"]["template"]["metadata"]["labels"])
    else:
        collector = COLLECTOR_PROD
    return of_kind(objects, "NetworkPolicy"), _endpoints(objects, collector)


@pytest.mark.parametrize("name", ["dev", "production"])
@pytest.mark.parametrize(("src", "dst", "port"), ALLOWED)
def test_call_graph_is_allowed(built: Built, name: str, src: str, dst: str, port: int) -> None:
    policies, endpoints = _graph(built, name)
    assert allowed(policies, endpoints[src], endpoints[dst], port), f"{src} -> {dst}:{port}"


@pytest.mark.parametrize("name", ["dev", "production"])
@pytest.mark.parametrize(("src", "dst", "port"), DENIED)
def test_calls_outside_the_graph_are_denied(
    built: Built, name: str, src: str, dst: str, port: int
) -> None:
    policies, endpoints = _graph(built, name)
    assert not allowed(policies, endpoints[src], endpoints[dst], port), f"{src} -> {dst}:{port}"


@pytest.mark.parametrize("name", ["base", "dev", "production"])
def test_everything_is_denied_by_default_and_dns_allowed(built: Built, name: str) -> None:
    policies = of_kind(built(name), "NetworkPolicy")
    deny = next(p for p in policies if p["metadata"]["name"] == "default-deny-all")
    assert deny["spec"] == {"podSelector": {}, "policyTypes": ["Ingress", "Egress"]}
    _, endpoints = _graph(built, "production" if name == "base" else name)
    for component in (*SERVICES, "migrate", "worker"):
        assert allowed(policies, endpoints[component], KUBE_DNS, 53, "UDP"), component
        assert allowed(policies, endpoints[component], KUBE_DNS, 53, "TCP"), component
        assert not allowed(policies, endpoints[component], KUBE_DNS, 80), component


@pytest.mark.parametrize("name", ["base", "dev", "production"])
def test_every_component_has_a_policy_of_its_own(built: Built, name: str) -> None:
    objects = built(name)
    policies = of_kind(objects, "NetworkPolicy")
    labelled = [t["metadata"]["labels"] for _, t in workloads(objects)]
    for labels in [*labelled, dict(WORKER.labels)]:
        own = [p for p in selecting(policies, labels) if p["spec"]["podSelector"]]
        assert own, f"no policy selects pods labelled {labels} specifically"
        for policy in own:
            assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
