"""Core ``v1`` ``Secret`` objects: the API server's rules for the paths the substrate uses to
deliver sandbox credentials (create, get, list by label, update, patch, delete).

The registry rules every kind shares (409 ``AlreadyExists`` and ``Conflict``, unconditional
updates without a ``resourceVersion``, delete preconditions, one resourceVersion counter) are
:mod:`.objects`'. Secret's own, as in ``pkg/registry/core/secret``:

* ``data`` values must be base64 and keys valid config keys (422 ``Invalid`` otherwise);
  ``stringData`` is merged into ``data`` (base64-encoded) and dropped, as the API server does;
  ``type`` defaults to ``Opaque`` and cannot change on update;

Not emulated: watch on Secrets (the substrate does not watch them), field selectors,
pagination (a list returns every match with no ``continue``), ownerReference garbage
collection (the substrate's sweep deletes orphans itself).
"""

from __future__ import annotations

import base64
import binascii
import re
from collections.abc import Callable
from typing import Any

from turnstile_testing.kube_emulator.errors import bad_request
from turnstile_testing.kube_emulator.objects import ObjectKind, ObjectStore

_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
SECRET = ObjectKind("Secret", "secrets")


def _validate(obj: dict[str, Any], current: dict[str, Any] | None) -> None:
    name = str(obj["metadata"].get("name") or "")
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
            raise SECRET.invalid(
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
    if current is not None and kind != current["type"]:
        raise SECRET.invalid(name, "type", "Invalid value: field is immutable")
    obj["type"] = kind


class SecretStore(ObjectStore):
    """Secrets by ``(namespace, name)``; versions come from ``next_version`` (the pods' counter)."""

    def __init__(self, next_version: Callable[[], int]) -> None:
        super().__init__(SECRET, _validate, next_version)
