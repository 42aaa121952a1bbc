"""``coordination.k8s.io/v1`` ``Lease`` objects: the API server's rules for the paths leader
election uses (create, get, list, update with optimistic concurrency, patch, delete).

The registry rules every kind shares (409 ``AlreadyExists`` and ``Conflict``, unconditional
updates without a ``resourceVersion`` — the lease strategy allows them — delete preconditions,
one resourceVersion counter) are :mod:`.objects`'. Lease's own, as in
``pkg/registry/coordination/lease``: the spec is validated as ``ValidateLeaseSpec`` does,
``leaseDurationSeconds`` positive and ``leaseTransitions`` non-negative when set.

Not emulated: watch on leases (leader election does not use it), field selectors, pagination.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from turnstile_testing.kube_emulator.errors import bad_request
from turnstile_testing.kube_emulator.objects import ObjectKind, ObjectStore

GROUP = "coordination.k8s.io"
VERSION = f"{GROUP}/v1"
LEASE = ObjectKind("Lease", "leases", GROUP)


def _validate(obj: dict[str, Any], current: dict[str, Any] | None) -> None:
    del current  # a lease's fields may all change
    name = str(obj["metadata"].get("name") or "")
    spec = obj.get("spec")
    if spec is None:
        obj["spec"] = spec = {}
    if not isinstance(spec, dict):
        raise bad_request("spec: expected an object")
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        raise LEASE.invalid(
            name, "spec.leaseDurationSeconds", "Invalid value: must be greater than 0"
        )
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        raise LEASE.invalid(
            name, "spec.leaseTransitions", "Invalid value: must be greater than or equal to 0"
        )
    holder = spec.get("holderIdentity")
    if holder is not None and not isinstance(holder, str):
        raise bad_request("spec.holderIdentity: expected a string")


class LeaseStore(ObjectStore):
    """Leases by ``(namespace, name)``; versions come from ``next_version`` (the pods' counter)."""

    def __init__(self, next_version: Callable[[], int]) -> None:
        super().__init__(LEASE, _validate, next_version)
