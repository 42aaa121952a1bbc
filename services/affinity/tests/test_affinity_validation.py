"""Remembered sandbox ids: only valid ones, and only so many."""

from __future__ import annotations

import pytest

from turnstile_affinity import validation
from turnstile_clientkeys import is_label_value
from turnstile_platform.errors import RichError


def test_a_remembered_sandbox_id_is_only_ever_a_valid_one() -> None:
    for value in ("a1", "sandbox-7", "x" * 63, "", "-a", "a b", "x" * 64, "é"):
        for _ in range(2):  # the second time, from memory if it was valid
            if is_label_value(value):
                assert validation.sandbox_id(value) == value
            else:
                with pytest.raises(RichError, match="sandbox_id"):
                    validation.sandbox_id(value)
        assert (value in validation._sandboxes) == is_label_value(value)


def test_remembered_sandbox_ids_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(validation, "_sandboxes", set())
    monkeypatch.setattr(validation, "MAX_REMEMBERED", 3)
    for i in range(10):
        assert validation.sandbox_id(f"s{i}") == f"s{i}"
    assert validation._sandboxes == {"s0", "s1", "s2"}
