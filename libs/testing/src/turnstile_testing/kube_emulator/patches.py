"""The three PATCH flavours the API server accepts for built-in types.

* JSON merge patch (RFC 7386): exact.
* JSON patch (RFC 6902): ``add``/``remove``/``replace``/``move``/``copy``/``test``, exact. A patch
  that cannot be decoded is a 400; one that decodes but does not apply (missing path, failed
  ``test``) is a 422 ``Invalid`` with the generic message, as ``jsonPatcher.applyJSPatch`` does.
* Strategic merge patch: **simplified**. Maps merge as in RFC 7386; lists whose field name is in
  :data:`LIST_MERGE_KEYS` merge item-by-item on that key (honouring ``$patch: delete`` items);
  primitive lists in :data:`PRIMITIVE_SET_LISTS` (``finalizers``) union; ``$patch: replace`` on a
  map, ``$retainKeys`` and ``$deleteFromPrimitiveList/<field>`` are honoured; ``$setElementOrder``
  is ignored. The merge key is chosen by field *name*, not by the Go schema path, which is right for
  every list inside a Pod that has a merge key. Every other list is replaced, as the real server
  does for atomic lists.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from turnstile_testing.kube_emulator.errors import ApiError, bad_request

#: Pod list fields with ``patchStrategy:"merge"`` and their ``patchMergeKey``.
LIST_MERGE_KEYS: dict[str, str] = {
    "containers": "name",
    "initContainers": "name",
    "ephemeralContainers": "name",
    "volumes": "name",
    "env": "name",
    "ports": "containerPort",
    "volumeMounts": "mountPath",
    "volumeDevices": "devicePath",
    "imagePullSecrets": "name",
    "hostAliases": "ip",
    "topologySpreadConstraints": "topologyKey",
    "resourceClaims": "name",
    "schedulingGates": "name",
    "conditions": "type",
    "ownerReferences": "uid",
    "podIPs": "ip",
    "hostIPs": "ip",
}

#: Primitive lists with merge strategy: a patch adds the missing values instead of replacing.
PRIMITIVE_SET_LISTS: frozenset[str] = frozenset({"finalizers"})

MERGE_PATCH = "application/merge-patch+json"
STRATEGIC_MERGE_PATCH = "application/strategic-merge-patch+json"
JSON_PATCH = "application/json-patch+json"
APPLY_PATCH = "application/apply-patch+yaml"


def _not_applicable(detail: str) -> ApiError:
    # The API server drops the json-patch library's detail from the message (it builds a generic
    # 422); keep it in the causes so emulator users can see what went wrong.
    return ApiError(
        422,
        "the server rejected our request due to an error in our request",
        "Invalid",
        {"causes": [{"reason": "FieldValueInvalid", "message": detail}]},
    )


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386: objects merge recursively, ``null`` deletes, anything else replaces."""
    if not isinstance(patch, dict):
        return patch
    result: dict[str, Any] = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            result.pop(key, None)
        else:
            result[key] = merge_patch(result.get(key), value)
    return result


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Simplified strategic merge (see the module docstring for what is honoured)."""
    if not isinstance(patch, dict):
        return patch
    if patch.get("$patch") == "replace":
        return _strip_directives(patch)
    result: dict[str, Any] = dict(target) if isinstance(target, dict) else {}
    retain = patch.get("$retainKeys")
    for key, value in patch.items():
        if key.startswith("$deleteFromPrimitiveList/"):
            name = key.split("/", 1)[1]
            if isinstance(result.get(name), list) and isinstance(value, list):
                result[name] = [v for v in result[name] if v not in value]
            continue
        if key.startswith("$"):
            continue
        if value is None:
            result.pop(key, None)
        elif isinstance(value, list) and key in LIST_MERGE_KEYS:
            result[key] = _merge_keyed_list(result.get(key), value, LIST_MERGE_KEYS[key])
        elif isinstance(value, list) and key in PRIMITIVE_SET_LISTS:
            have = list(result.get(key) or [])
            result[key] = have + [v for v in value if v not in have]
        else:
            result[key] = strategic_merge_patch(result.get(key), value)
    if isinstance(retain, list):
        result = {k: v for k, v in result.items() if k in retain}
    return result


def _merge_keyed_list(target: Any, patch: list[Any], merge_key: str) -> list[Any]:
    items: list[Any] = list(target) if isinstance(target, list) else []
    for entry in patch:
        if not isinstance(entry, dict) or merge_key not in entry:
            items.append(entry)
            continue
        index = next(
            (
                i
                for i, item in enumerate(items)
                if isinstance(item, dict) and item.get(merge_key) == entry[merge_key]
            ),
            None,
        )
        if entry.get("$patch") == "delete":
            if index is not None:
                del items[index]
        elif index is None:
            items.append(_strip_directives(entry))
        else:
            items[index] = strategic_merge_patch(items[index], entry)
    return items


def _strip_directives(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _strip_directives(v) for k, v in value.items() if not k.startswith("$")}
    if isinstance(value, list):
        return [_strip_directives(v) for v in value]
    return value


def _json_equal(a: Any, b: Any) -> bool:
    """JSON equality: unlike Python's ``==``, ``true`` never equals ``1``."""
    if isinstance(a, bool) or isinstance(b, bool):
        return isinstance(a, bool) and isinstance(b, bool) and a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_json_equal(a[k], b[k]) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_json_equal(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, int | float) and isinstance(b, int | float):
        return a == b
    return type(a) is type(b) and bool(a == b)


def _pointer(path: Any) -> list[str]:
    if not isinstance(path, str):
        raise bad_request("json patch: path must be a string")
    if path == "":
        return []
    if not path.startswith("/"):
        raise _not_applicable(f'json patch: invalid path "{path}"')
    return [p.replace("~1", "/").replace("~0", "~") for p in path[1:].split("/")]


def _resolve(doc: Any, parts: list[str], path: str) -> Any:
    node = doc
    for part in parts:
        if isinstance(node, dict) and part in node:
            node = node[part]
        elif isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        else:
            raise _not_applicable(f'doc is missing path: "{path}"')
    return node


def _list_index(node: list[Any], part: str, path: str, *, inserting: bool) -> int:
    if inserting and part == "-":
        return len(node)
    if not part.isdigit() or (part != "0" and part.startswith("0")):
        raise _not_applicable(f'invalid array index in "{path}"')
    index = int(part)
    if index > len(node) or (not inserting and index == len(node)):
        raise _not_applicable(f'array index out of bounds in "{path}"')
    return index


def _add(doc: Any, parts: list[str], value: Any, path: str) -> Any:
    if not parts:
        return value
    parent = _resolve(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict):
        parent[last] = value
    elif isinstance(parent, list):
        parent.insert(_list_index(parent, last, path, inserting=True), value)
    else:
        raise _not_applicable(f'add operation does not apply: doc is missing path: "{path}"')
    return doc


def _remove(doc: Any, parts: list[str], path: str) -> tuple[Any, Any]:
    if not parts:
        raise _not_applicable("remove operation does not apply to the document root")
    parent = _resolve(doc, parts[:-1], path)
    last = parts[-1]
    if isinstance(parent, dict) and last in parent:
        return doc, parent.pop(last)
    if isinstance(parent, list):
        return doc, parent.pop(_list_index(parent, last, path, inserting=False))
    raise _not_applicable(f'remove operation does not apply: doc is missing path: "{path}"')


def json_patch(doc: Any, operations: Any) -> Any:
    """Apply an RFC 6902 patch to ``doc`` (mutated in place and returned)."""
    if not isinstance(operations, list):
        raise bad_request("json: cannot unmarshal object into Go value of type jsonpatch.Patch")
    for op in operations:
        if not isinstance(op, dict) or not isinstance(op.get("op"), str):
            raise bad_request("json patch: each operation needs a string 'op'")
        kind = op["op"]
        path = op.get("path")
        parts = _pointer(path)
        if kind in ("add", "replace", "test") and "value" not in op:
            raise bad_request(f"json patch: {kind} operation has no value")
        if kind == "add":
            doc = _add(doc, parts, copy.deepcopy(op["value"]), str(path))
        elif kind == "remove":
            doc, _ = _remove(doc, parts, str(path))
        elif kind == "replace":
            if parts:
                _resolve(doc, parts, str(path))  # must exist
                doc, _ = _remove(doc, parts, str(path))
            doc = _add(doc, parts, copy.deepcopy(op["value"]), str(path))
        elif kind in ("move", "copy"):
            source = op.get("from")
            from_parts = _pointer(source)
            if kind == "move":
                doc, value = _remove(doc, from_parts, str(source))
            else:
                value = copy.deepcopy(_resolve(doc, from_parts, str(source)))
            doc = _add(doc, parts, value, str(path))
        elif kind == "test":
            try:
                have = _resolve(doc, parts, str(path))
            except ApiError:
                have = None
            if not _json_equal(have, op["value"]):
                raise _not_applicable(f'testing value "{path}" failed: test failed')
        else:
            raise bad_request(f"Unexpected kind: {kind}")
    return doc


def apply_patch(content_type: str, current: dict[str, Any], body: bytes) -> dict[str, Any]:
    """Apply a PATCH body of the given media type to a (private copy of a) pod."""
    media = content_type.split(";", 1)[0].strip().lower()
    if media == APPLY_PATCH:
        raise ApiError(
            415,
            "the emulator does not implement server-side apply (application/apply-patch+yaml)",
            "UnsupportedMediaType",
        )
    if media not in (MERGE_PATCH, STRATEGIC_MERGE_PATCH, JSON_PATCH):
        raise ApiError(
            415,
            f"the body of the request was in an unknown format - accepted media types "
            f"include: {JSON_PATCH}, {MERGE_PATCH}, {STRATEGIC_MERGE_PATCH}, {APPLY_PATCH}",
            "UnsupportedMediaType",
        )
    try:
        patch = json.loads(body)
    except ValueError as exc:
        raise bad_request(f"error decoding patch: {exc}") from None
    if media == JSON_PATCH:
        result = json_patch(current, patch)
    else:
        if not isinstance(patch, dict):
            raise bad_request(
                "json: cannot unmarshal non-object into Go value of type map[string]interface {}"
            )
        if media == MERGE_PATCH:
            result = merge_patch(current, patch)
        else:
            result = strategic_merge_patch(current, patch)
    if not isinstance(result, dict):
        raise _not_applicable("the patched document is not a JSON object")
    return result
