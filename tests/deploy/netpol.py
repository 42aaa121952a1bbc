"""A small NetworkPolicy evaluator: is a TCP connection from one endpoint to another
allowed by the policies of a namespace?

It follows the networking.k8s.io/v1 semantics the manifests use: a pod selected by
any policy with a policy type is isolated in that direction, and then a
connection needs a rule of one of those policies allowing the peer and port;
traffic is allowed when both the source's egress and the destination's ingress
allow it. Peers are matched by podSelector (same namespace), namespaceSelector
(+ podSelector) and ipBlock. An ipBlock of 0.0.0.0/0 is taken to match pods too,
as it does under most CNIs, so forbidden-edge checks stay conservative.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from .manifests import Obj


@dataclass(frozen=True)
class Endpoint:
    """One side of a connection: a pod (labels, namespace) or an address outside
    the pod network (``pod=False``, e.g. the API server)."""

    name: str
    labels: Mapping[str, str] = field(default_factory=dict)
    namespace: str = "turnstile"
    namespace_labels: Mapping[str, str] = field(default_factory=dict)
    pod: bool = True

    def ns_labels(self) -> dict[str, str]:
        return {"kubernetes.io/metadata.name": self.namespace, **self.namespace_labels}


def selector_matches(selector: Mapping[str, Any] | None, labels: Mapping[str, str]) -> bool:
    """metav1.LabelSelector semantics; an empty selector matches everything."""
    if selector is None:
        return True
    for key, value in (selector.get("matchLabels") or {}).items():
        if labels.get(key) != value:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, values = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in values:
            return False
        if op == "NotIn" and key in labels and labels[key] in values:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


def _peer_matches(peer: Mapping[str, Any], other: Endpoint, policy_namespace: str) -> bool:
    if "ipBlock" in peer:
        return (not other.pod) or peer["ipBlock"]["cidr"] in ("0.0.0.0/0", "::/0")
    if not other.pod:
        return False
    if "namespaceSelector" in peer:
        if not selector_matches(peer["namespaceSelector"], other.ns_labels()):
            return False
    elif other.namespace != policy_namespace:
        return False
    return selector_matches(peer.get("podSelector"), other.labels)


def _port_matches(ports: list[Mapping[str, Any]] | None, port: int, protocol: str) -> bool:
    if not ports:
        return True
    for entry in ports:
        if entry.get("protocol", "TCP") != protocol:
            continue
        if "port" not in entry:
            return True
        start = entry["port"]
        if isinstance(start, int) and start <= port <= entry.get("endPort", start):
            return True
    return False


def _rule_allows(
    rule: Mapping[str, Any],
    peers_key: str,
    other: Endpoint,
    port: int,
    protocol: str,
    policy_namespace: str,
) -> bool:
    peers = rule.get(peers_key)
    peer_ok = not peers or any(_peer_matches(p, other, policy_namespace) for p in peers)
    return peer_ok and _port_matches(rule.get("ports"), port, protocol)


def _direction_allows(
    policies: list[Obj],
    subject: Endpoint,
    other: Endpoint,
    port: int,
    protocol: str,
    direction: str,
) -> bool:
    rules_key, peers_key = ("egress", "to") if direction == "Egress" else ("ingress", "from")
    applicable = [
        p
        for p in policies
        if p["metadata"].get("namespace", "turnstile") == subject.namespace
        and direction in p["spec"].get("policyTypes", ["Ingress"])
        and selector_matches(p["spec"]["podSelector"], subject.labels)
    ]
    if not applicable:
        return True  # not isolated in this direction
    return any(
        _rule_allows(rule, peers_key, other, port, protocol, subject.namespace)
        for p in applicable
        for rule in p["spec"].get(rules_key) or []
    )


def allowed(
    policies: list[Obj], src: Endpoint, dst: Endpoint, port: int, protocol: str = "TCP"
) -> bool:
    """Whether policies let ``src`` open a connection to ``dst`` on ``port``."""
    egress_ok = not src.pod or _direction_allows(policies, src, dst, port, protocol, "Egress")
    ingress_ok = not dst.pod or _direction_allows(policies, dst, src, port, protocol, "Ingress")
    return egress_ok and ingress_ok


def selecting(policies: list[Obj], labels: Mapping[str, str]) -> list[Obj]:
    """Policies whose podSelector selects pods with these labels."""
    return [p for p in policies if selector_matches(p["spec"]["podSelector"], labels)]
