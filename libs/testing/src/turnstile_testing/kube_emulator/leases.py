"""``coordination.k8s.io/v1`` ``Lease`` objects: the API server's rules for the paths leader
election uses (create, get, list, update with optimistic concurrency, patch, delete).

As in the real registry (``pkg/registry/coordination/lease``):

* a create on a taken name is 409 ``AlreadyExists``; client-set ``uid``/``creationTimestamp`` are
  replaced, a set ``resourceVersion`` is refused;
* an update carrying a ``metadata.resourceVersion`` other than the current one is 409
  ``Conflict``; one without is unconditional (the lease strategy allows it);
* the spec is validated as ``ValidateLeaseSpec`` does: ``leaseDurationSeconds`` must be positive
  and ``leaseTransitions`` non-negative when set;
* leases share the server's resourceVersion counter with pods, as every etcd key shares one
  revision.

Not emulated: watch on leases (leader election does not use it), field selectors, pagination.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from typing import Any

from turnstile_testing.kube_emulator.errors import ApiError, bad_request
from turnstile_testing.kube_emulator.pods import validate_name
from turnstile_testing.kube_emulator.selectors import LabelSelector

GROUP = "coordination.k8s.io"
VERSION = f"{GROUP}/v1"


def _not_found(name: str) -> ApiError:
    return ApiError(
        404,
        f'leases.{GROUP} "{name}" not found',
        "NotFound",
        {"name": name, "group": GROUP, "kind": "leases"},
    )


def _already_exists(name: str) -> ApiError:
    return ApiError(
        409,
        f'leases.{GROUP} "{name}" already exists',
        "AlreadyExists",
        {"name": name, "group": GROUP, "kind": "leases"},
    )


def _conflict(name: str) -> ApiError:
    return ApiError(
        409,
        f'Operation cannot be fulfilled on leases.{GROUP} "{name}": the object has been '
        "modified; please apply your changes to the latest version and try again",
        "Conflict",
        {"name": name, "group": GROUP, "kind": "leases"},
    )


def _invalid(name: str, field: str, detail: str) -> ApiError:
    return ApiError(
        422,
        f'Lease.{GROUP} "{name}" is invalid: {field}: {detail}',
        "Invalid",
        {
            "name": name,
            "group": GROUP,
            "kind": "Lease",
            "causes": [{"reason": "FieldValueInvalid", "message": detail, "field": field}],
        },
    )


def _validate(obj: dict[str, Any]) -> None:
    meta = obj["metadata"]
    name = str(meta.get("name") or "")
    try:
        validate_name(name)
    except ApiError as error:
        raise _invalid(name, "metadata.name", error.message.split(": ", 2)[-1]) from None
    spec = obj.get("spec")
    if spec is None:
        obj["spec"] = spec = {}
    if not isinstance(spec, dict):
        raise bad_request("spec: expected an object")
    duration = spec.get("leaseDurationSeconds")
    if duration is not None and (not isinstance(duration, int) or duration <= 0):
        raise _invalid(name, "spec.leaseDurationSeconds", "Invalid value: must be greater than 0")
    transitions = spec.get("leaseTransitions")
    if transitions is not None and (not isinstance(transitions, int) or transitions < 0):
        raise _invalid(
            name, "spec.leaseTransitions", "Invalid value: must be greater than or equal to 0"
        )
    holder = spec.get("holderIdentity")
    if holder is not None and not isinstance(holder, str):
        raise bad_request("spec.holderIdentity: expected a string")


class LeaseStore:
    """Leases by ``(namespace, name)``; versions come from ``next_version`` (the pods' counter)."""

    def __init__(self, next_version: Callable[[], int]) -> None:
        self._leases: dict[tuple[str, str], dict[str, Any]] = {}
        self._next_version = next_version

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """A copy of the lease, or 404."""
        found = self._leases.get((namespace, name))
        if found is None:
            raise _not_found(name)
        return _copy(found)

    def list(self, namespace: str | None, label_selector: str | None) -> list[dict[str, Any]]:
        """Copies of the matching leases, sorted by namespace and name."""
        selector = LabelSelector.parse(label_selector)
        return [
            _copy(lease)
            for key, lease in sorted(self._leases.items())
            if (namespace is None or key[0] == namespace)
            and selector.matches(lease["metadata"].get("labels") or {})
        ]

    def create(self, namespace: str, body: Any) -> dict[str, Any]:
        obj = _body(body)
        meta = obj["metadata"]
        if meta.get("namespace", namespace) != namespace:
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on the "
                "request"
            )
        if meta.get("resourceVersion"):
            raise ApiError(500, "resourceVersion should not be set on objects to be created")
        meta["namespace"] = namespace
        _validate(obj)
        key = (namespace, str(meta["name"]))
        if key in self._leases:
            raise _already_exists(key[1])
        meta["uid"] = str(uuid.uuid4())
        from turnstile_testing.kube_emulator.store import now_rfc3339

        meta["creationTimestamp"] = now_rfc3339()
        return self._store(key, obj)

    def replace(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        current = self._leases.get((namespace, name))
        if current is None:
            raise _not_found(name)
        obj = _body(body)
        meta = obj["metadata"]
        if meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the "
                f"URL ({name})"
            )
        if meta.get("namespace", namespace) != namespace:
            raise bad_request(
                "the namespace of the provided object does not match the namespace sent on the "
                "request"
            )
        wanted = meta.get("resourceVersion")
        if wanted not in (None, "") and str(wanted) != current["metadata"]["resourceVersion"]:
            raise _conflict(name)
        meta.update(name=name, namespace=namespace)
        for system in ("uid", "creationTimestamp"):
            meta[system] = current["metadata"][system]
        _validate(obj)
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        if obj == current:
            return _copy(current)
        return self._store((namespace, name), obj)

    def delete(self, namespace: str, name: str, preconditions: dict[str, Any] | None) -> None:
        current = self._leases.get((namespace, name))
        if current is None:
            raise _not_found(name)
        pre = preconditions or {}
        for field in ("uid", "resourceVersion"):
            if pre.get(field) not in (None, "", current["metadata"][field]):
                raise _conflict(name)
        del self._leases[(namespace, name)]
        self._next_version()

    def _store(self, key: tuple[str, str], obj: dict[str, Any]) -> dict[str, Any]:
        obj["apiVersion"] = VERSION
        obj["kind"] = "Lease"
        obj["metadata"]["resourceVersion"] = str(self._next_version())
        self._leases[key] = obj
        return _copy(obj)


def _copy(obj: dict[str, Any]) -> dict[str, Any]:
    copied: dict[str, Any] = json.loads(json.dumps(obj))
    return copied


def _body(body: Any) -> dict[str, Any]:
    if not isinstance(body, dict):
        raise bad_request("the body of the request must be a JSON object")
    obj = _copy(body)
    meta = obj.get("metadata")
    if not isinstance(meta, dict):
        obj["metadata"] = {}
    return obj
