"""Kubernetes label-value validation, exactly as the API server applies it.

A label value is empty or at most 63 characters of ``[A-Za-z0-9._-]`` that
begins and ends with an alphanumeric (``k8s.io/apimachinery``
``IsValidLabelValue``). Client ids are never empty, so :func:`is_label_value`
also rejects ``""``.
"""

from __future__ import annotations

import re

MAX_LABEL_VALUE_LENGTH = 63

_LABEL_VALUE = re.compile(r"(?:[A-Za-z0-9](?:[-A-Za-z0-9_.]*[A-Za-z0-9])?)")


def is_label_value(value: str) -> bool:
    """Whether ``value`` is a non-empty, valid Kubernetes label value."""
    return (
        0 < len(value) <= MAX_LABEL_VALUE_LENGTH
        and value.isascii()
        and _LABEL_VALUE.fullmatch(value) is not None
    )
