"""The patch functions on their own: the directives the strategic merge honours."""

from __future__ import annotations

import pytest

from turnstile_testing.kube_emulator import ApiError
from turnstile_testing.kube_emulator.patches import json_patch, merge_patch, strategic_merge_patch


def test_merge_patch_replaces_lists_and_null_deletes() -> None:
    doc = {"a": {"b": 1, "c": 2}, "l": [1, 2]}

    assert merge_patch(doc, {"a": {"b": None}, "l": [3]}) == {"a": {"c": 2}, "l": [3]}


def test_strategic_patch_delete_directive_removes_a_keyed_item() -> None:
    doc = {"conditions": [{"type": "Ready", "status": "True"}, {"type": "X", "status": "1"}]}
    patch = {"conditions": [{"type": "X", "$patch": "delete"}, {"type": "Y", "status": "0"}]}

    assert strategic_merge_patch(doc, patch) == {
        "conditions": [{"type": "Ready", "status": "True"}, {"type": "Y", "status": "0"}]
    }


def test_strategic_patch_unions_finalizers_and_can_delete_from_them() -> None:
    doc = {"finalizers": ["a", "b"]}

    assert strategic_merge_patch(doc, {"finalizers": ["b", "c"]}) == {"finalizers": ["a", "b", "c"]}
    assert strategic_merge_patch(doc, {"$deleteFromPrimitiveList/finalizers": ["a"]}) == {
        "finalizers": ["b"]
    }


def test_strategic_patch_replace_and_retain_keys_directives() -> None:
    doc = {"m": {"a": 1, "b": 2}}

    assert strategic_merge_patch(doc, {"m": {"$patch": "replace", "c": 3}}) == {"m": {"c": 3}}
    assert strategic_merge_patch(doc, {"m": {"$retainKeys": ["a"], "a": 5}}) == {"m": {"a": 5}}


def test_strategic_patch_replaces_lists_without_a_merge_key() -> None:
    doc = {"tolerations": [{"key": "a"}]}

    assert strategic_merge_patch(doc, {"tolerations": [{"key": "b"}]}) == {
        "tolerations": [{"key": "b"}]
    }


def test_json_patch_move_copy_and_array_append() -> None:
    doc = {"a": {"x": 1}, "l": [1]}
    ops = [
        {"op": "copy", "from": "/a/x", "path": "/a/y"},
        {"op": "move", "from": "/a/x", "path": "/z"},
        {"op": "add", "path": "/l/-", "value": 2},
        {"op": "add", "path": "/l/0", "value": 0},
    ]

    assert json_patch(doc, ops) == {"a": {"y": 1}, "z": 1, "l": [0, 1, 2]}


def test_json_patch_test_distinguishes_true_from_one() -> None:
    with pytest.raises(ApiError) as caught:
        json_patch({"a": 1}, [{"op": "test", "path": "/a", "value": True}])

    assert caught.value.code == 422
