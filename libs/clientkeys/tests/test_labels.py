"""Label-value validation agrees with the Kubernetes rules (IsValidLabelValue)."""

from __future__ import annotations

import string

from hypothesis import example, given
from hypothesis import strategies as st

from turnstile_clientkeys import MAX_LABEL_VALUE_LENGTH, is_label_value

ALNUM = set(string.ascii_letters + string.digits)
MIDDLE = ALNUM | set("-_.")


def kubernetes_rule(value: str) -> bool:
    """The rule as the Kubernetes docs state it, written without a regex: at most
    63 characters, alphanumerics, '-', '_' or '.' between, alphanumeric at both
    ends. (Client ids are never empty, so the empty value is rejected here.)"""
    if not value or len(value) > 63:
        return False
    if value[0] not in ALNUM or value[-1] not in ALNUM:
        return False
    return all(ch in MIDDLE for ch in value)


label_like = st.text(alphabet=string.ascii_letters + string.digits + "-_.", max_size=70)
anything = st.text(max_size=70)
boundary = st.builds(
    lambda head, n, tail: head + "a" * n + tail,
    st.sampled_from(["a", "Z9", "-", "_a", "."]),
    st.integers(min_value=58, max_value=66),
    st.sampled_from(["", "z", "-", "0", "é", "."]),
)


@given(st.one_of(label_like, anything, boundary))
@example("a" * 63)
@example("a" * 64)
@example("")
@example("a-b_c.d")
@example("-a")
@example("a\n")
@example("ａ")  # a full-width letter: alphanumeric to Python, not to Kubernetes
def test_label_validation_agrees_with_kubernetes_rules(value: str) -> None:
    assert is_label_value(value) == kubernetes_rule(value)


def test_the_63_character_boundary() -> None:
    assert MAX_LABEL_VALUE_LENGTH == 63
    assert is_label_value("x" * 63)
    assert not is_label_value("x" * 64)
