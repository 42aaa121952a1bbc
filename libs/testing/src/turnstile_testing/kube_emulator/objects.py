"""One generic store for the emulator's namespaced objects other than pods (Leases, Secrets).

Every such kind follows the same registry rules (``k8s.io/apiserver``'s generic store), which
live here once:

* a create on a taken name is 409 ``AlreadyExists``; client-set ``uid``/``creationTimestamp``
  are replaced, a set ``resourceVersion`` is refused, the name must be a DNS subdomain;
* an update carrying a ``metadata.resourceVersion`` other than the current one is 409
  ``Conflict``; one without is unconditional; an update that changes nothing keeps the
  version;
* a delete honours ``uid``/``resourceVersion`` preconditions (409 ``Conflict``);
* every object shares the server's resourceVersion counter with pods, as every etcd key shares
  one revision.

What differs per kind — its names, its group, and the validation of its own fields — is an
:class:`ObjectKind` and a validator. Not emulated for these kinds: watch, field selectors,
pagination (a list returns every match with no ``continue``).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from turnstile_testing.kube_emulator.errors import ApiError, bad_request
from turnstile_testing.kube_emulator.pods import validate_name
from turnstile_testing.kube_emulator.selectors import LabelSelector


@dataclass(frozen=True)
class ObjectKind:
    """A kind's names, as the API server spells them in its errors."""

    kind: str
    """``Lease``, ``Secret``."""
    resource: str
    """The plural resource: ``leases``, ``secrets``."""
    group: str = ""
    """The API group; empty for core ``v1``."""

    @property
    def api_version(self) -> str:
        return f"{self.group}/v1" if self.group else "v1"

    def _qualified(self, name: str) -> str:
        return f"{name}.{self.group}" if self.group else name

    def _details(self, name: str, kind: str) -> dict[str, Any]:
        details: dict[str, Any] = {"name": name}
        if self.group:
            details["group"] = self.group
        details["kind"] = kind
        return details

    def not_found(self, name: str) -> ApiError:
        return ApiError(
            404,
            f'{self._qualified(self.resource)} "{name}" not found',
            "NotFound",
            self._details(name, self.resource),
        )

    def already_exists(self, name: str) -> ApiError:
        return ApiError(
            409,
            f'{self._qualified(self.resource)} "{name}" already exists',
            "AlreadyExists",
            self._details(name, self.resource),
        )

    def conflict(self, name: str) -> ApiError:
        return ApiError(
            409,
            f'Operation cannot be fulfilled on {self._qualified(self.resource)} "{name}": the '
            "object has been modified; please apply your changes to the latest version and try "
            "again",
            "Conflict",
            self._details(name, self.resource),
        )

    def invalid(self, name: str, field: str, detail: str) -> ApiError:
        """``Kind "x" is invalid: field: detail`` (422 Invalid)."""
        details = self._details(name, self.kind)
        details["causes"] = [{"reason": "FieldValueInvalid", "message": detail, "field": field}]
        return ApiError(
            422,
            f'{self._qualified(self.kind)} "{name}" is invalid: {field}: {detail}',
            "Invalid",
            details,
        )


#: Checks (and normalises) a kind's own fields of ``obj``; ``current`` is the stored object on
#: an update, None on a create. Raises :class:`ApiError`.
Validator = Callable[[dict[str, Any], dict[str, Any] | None], None]


class ObjectStore:
    """Objects of one kind by ``(namespace, name)``; versions come from ``next_version``."""

    def __init__(
        self, kind: ObjectKind, validate: Validator, next_version: Callable[[], int]
    ) -> None:
        self.kind = kind
        self._validate_fields = validate
        self._objects: dict[tuple[str, str], dict[str, Any]] = {}
        self._next_version = next_version

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """A copy of the object, or 404."""
        found = self._objects.get((namespace, name))
        if found is None:
            raise self.kind.not_found(name)
        return _copy(found)

    def list(self, namespace: str | None, label_selector: str | None) -> list[dict[str, Any]]:
        """Copies of the matching objects, sorted by namespace and name."""
        selector = LabelSelector.parse(label_selector)
        return [
            _copy(obj)
            for key, obj in sorted(self._objects.items())
            if (namespace is None or key[0] == namespace)
            and selector.matches(obj["metadata"].get("labels") or {})
        ]

    def create(self, namespace: str, body: Any) -> dict[str, Any]:
        from turnstile_testing.kube_emulator.store import now_rfc3339

        obj = _body(body)
        meta = obj["metadata"]
        _check_namespace(meta, namespace)
        if meta.get("resourceVersion"):
            raise ApiError(500, "resourceVersion should not be set on objects to be created")
        meta["namespace"] = namespace
        self._validate(obj, None)
        key = (namespace, str(meta["name"]))
        if key in self._objects:
            raise self.kind.already_exists(key[1])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        return self._store(key, obj)

    def replace(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        current = self._objects.get((namespace, name))
        if current is None:
            raise self.kind.not_found(name)
        obj = _body(body)
        meta = obj["metadata"]
        if meta.get("name", name) != name:
            raise bad_request(
                f"the name of the object ({meta.get('name')}) does not match the name on the "
                f"URL ({name})"
            )
        _check_namespace(meta, namespace)
        wanted = meta.get("resourceVersion")
        if wanted not in (None, "") and str(wanted) != current["metadata"]["resourceVersion"]:
            raise self.kind.conflict(name)
        meta.update(name=name, namespace=namespace)
        for system in ("uid", "creationTimestamp"):
            meta[system] = current["metadata"][system]
        self._validate(obj, current)
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        obj["apiVersion"], obj["kind"] = self.kind.api_version, self.kind.kind
        if obj == current:
            return _copy(current)
        return self._store((namespace, name), obj)

    def delete(self, namespace: str, name: str, preconditions: dict[str, Any] | None) -> None:
        current = self._objects.get((namespace, name))
        if current is None:
            raise self.kind.not_found(name)
        pre = preconditions or {}
        for field in ("uid", "resourceVersion"):
            if pre.get(field) not in (None, "", current["metadata"][field]):
                raise self.kind.conflict(name)
        del self._objects[(namespace, name)]
        self._next_version()

    def _validate(self, obj: dict[str, Any], current: dict[str, Any] | None) -> None:
        name = str(obj["metadata"].get("name") or "")
        try:
            validate_name(name)
        except ApiError as error:
            detail = error.message.split(": ", 2)[-1]
            raise self.kind.invalid(name, "metadata.name", detail) from None
        self._validate_fields(obj, current)

    def _store(self, key: tuple[str, str], obj: dict[str, Any]) -> dict[str, Any]:
        obj["apiVersion"] = self.kind.api_version
        obj["kind"] = self.kind.kind
        obj["metadata"]["resourceVersion"] = str(self._next_version())
        self._objects[key] = obj
        return _copy(obj)


def _check_namespace(meta: dict[str, Any], namespace: str) -> None:
    if meta.get("namespace", namespace) != namespace:
        raise bad_request(
            "the namespace of the provided object does not match the namespace sent on the request"
        )


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
