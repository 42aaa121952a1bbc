"""Core ``v1`` ``Secret`` objects: the API server's rules for the paths the substrate uses to
deliver sandbox credentials (create, get, list by label, update, patch, delete).

As in the real registry (``pkg/registry/core/secret``):

* a create on a taken name is 409 ``AlreadyExists``; client-set ``uid``/``creationTimestamp``
  are replaced, a set ``resourceVersion`` is refused;
* an update carrying a ``metadata.resourceVersion`` other than the current one is 409
  ``Conflict``; one without is unconditional;
* ``data`` values must be base64 and keys valid config keys (422 ``Invalid`` otherwise);
  ``stringData`` is merged into ``data`` (base64-encoded) and dropped, as the API server does;
  ``type`` defaults to ``Opaque`` and cannot change on update;
* a delete honours ``uid``/``resourceVersion`` preconditions (409 ``Conflict``);
* Secrets share the server's resourceVersion counter with pods and leases.

Not emulated: watch on Secrets (the substrate does not watch them), field selectors,
pagination (a list returns every match with no ``continue``), ownerReference garbage
collection (the substrate's sweep deletes orphans itself).
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from collections.abc import Callable
from typing import Any

from turnstile_testing.kube_emulator.errors import ApiError, bad_request
from turnstile_testing.kube_emulator.pods import validate_name
from turnstile_testing.kube_emulator.selectors import LabelSelector

_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")


def _details(name: str) -> dict[str, Any]:
    return {"name": name, "kind": "secrets"}


def _not_found(name: str) -> ApiError:
    return ApiError(404, f'secrets "{name}" not found', "NotFound", _details(name))


def _already_exists(name: str) -> ApiError:
    return ApiError(409, f'secrets "{name}" already exists', "AlreadyExists", _details(name))


def _conflict(name: str) -> ApiError:
    return ApiError(
        409,
        f'Operation cannot be fulfilled on secrets "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        "Conflict",
        _details(name),
    )


def _invalid(name: str, field: str, detail: str) -> ApiError:
    return ApiError(
        422,
        f'Secret "{name}" is invalid: {field}: {detail}',
        "Invalid",
        {
            "name": name,
            "kind": "Secret",
            "causes": [{"reason": "FieldValueInvalid", "message": detail, "field": field}],
        },
    )


def _validate(obj: dict[str, Any], previous_type: str | None) -> None:
    meta = obj["metadata"]
    name = str(meta.get("name") or "")
    try:
        validate_name(name)
    except ApiError as error:
        raise _invalid(name, "metadata.name", error.message.split(": ", 2)[-1]) from None
    data = obj.get("data")
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise bad_request("data: expected an object")
    string_data = obj.pop("stringData", None) or {}
    if not isinstance(string_data, dict):
        raise bad_request("stringData: expected an object")
    for key, value in string_data.items():
        if not isinstance(value, str):
            raise bad_request(f"stringData.{key}: expected a string")
        data[key] = base64.b64encode(value.encode()).decode("ascii")
    for key, value in data.items():
        if not _KEY.match(key):
            raise _invalid(
                name,
                f"data[{key}]",
                "Invalid value: a valid config key must consist of alphanumeric characters, "
                "'-', '_' or '.'",
            )
        try:
            base64.b64decode(str(value), validate=True)
        except (binascii.Error, ValueError):
            raise bad_request(f"data[{key}]: illegal base64 data") from None
    if data:
        obj["data"] = data
    else:
        obj.pop("data", None)
    kind = obj.get("type") or "Opaque"
    if previous_type is not None and kind != previous_type:
        raise _invalid(name, "type", "Invalid value: field is immutable")
    obj["type"] = kind


class SecretStore:
    """Secrets by ``(namespace, name)``; versions come from ``next_version`` (the pods' counter)."""

    def __init__(self, next_version: Callable[[], int]) -> None:
        self._secrets: dict[tuple[str, str], dict[str, Any]] = {}
        self._next_version = next_version

    def get(self, namespace: str, name: str) -> dict[str, Any]:
        """A copy of the Secret, or 404."""
        found = self._secrets.get((namespace, name))
        if found is None:
            raise _not_found(name)
        return _copy(found)

    def list(self, namespace: str | None, label_selector: str | None) -> list[dict[str, Any]]:
        """Copies of the matching Secrets, sorted by namespace and name."""
        selector = LabelSelector.parse(label_selector)
        return [
            _copy(secret)
            for key, secret in sorted(self._secrets.items())
            if (namespace is None or key[0] == namespace)
            and selector.matches(secret["metadata"].get("labels") or {})
        ]

    def create(self, namespace: str, body: Any) -> dict[str, Any]:
        from turnstile_testing.kube_emulator.store import now_rfc3339

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
        _validate(obj, None)
        key = (namespace, str(meta["name"]))
        if key in self._secrets:
            raise _already_exists(key[1])
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = now_rfc3339()
        return self._store(key, obj)

    def replace(self, namespace: str, name: str, body: Any) -> dict[str, Any]:
        current = self._secrets.get((namespace, name))
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
        _validate(obj, current["type"])
        meta["resourceVersion"] = current["metadata"]["resourceVersion"]
        obj["apiVersion"], obj["kind"] = "v1", "Secret"
        if obj == current:
            return _copy(current)
        return self._store((namespace, name), obj)

    def delete(self, namespace: str, name: str, preconditions: dict[str, Any] | None) -> None:
        current = self._secrets.get((namespace, name))
        if current is None:
            raise _not_found(name)
        pre = preconditions or {}
        for field in ("uid", "resourceVersion"):
            if pre.get(field) not in (None, "", current["metadata"][field]):
                raise _conflict(name)
        del self._secrets[(namespace, name)]
        self._next_version()

    def _store(self, key: tuple[str, str], obj: dict[str, Any]) -> dict[str, Any]:
        obj["apiVersion"] = "v1"
        obj["kind"] = "Secret"
        obj["metadata"]["resourceVersion"] = str(self._next_version())
        self._secrets[key] = obj
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
