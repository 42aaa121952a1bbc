"""Label and field selectors with the API server's grammar and matching rules.

Label selectors follow ``k8s.io/apimachinery/pkg/labels``: comma-joined requirements of the forms
``k=v``, ``k==v``, ``k!=v``, ``k in (a,b)``, ``k notin (a,b)``, ``k`` (exists), ``!k`` (does not
exist), ``k>n`` and ``k<n``. Note the negative forms (``!=``, ``notin``) also match objects that
lack the key, as on the real server.

Field selectors follow ``k8s.io/apimachinery/pkg/fields``: comma-joined ``f=v``, ``f==v``, ``f!=v``
over the fields the pod registry indexes (``PodToSelectableFields``); an absent field reads as the
empty string, so ``spec.nodeName=`` selects unscheduled pods. Unsupported fields are a 400 as on the
real server, so a typo in production code fails in tests instead of silently matching everything.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from turnstile_testing.kube_emulator.errors import ApiError, bad_request

_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
_SPECIAL = set("!=(),<> \t\n")

#: Pod fields the registry exposes to field selectors, with how each is read from a pod.
POD_FIELDS: dict[str, Callable[[Mapping[str, Any]], str]] = {
    "metadata.name": lambda p: str(p.get("metadata", {}).get("name", "")),
    "metadata.namespace": lambda p: str(p.get("metadata", {}).get("namespace", "")),
    "spec.nodeName": lambda p: str(p.get("spec", {}).get("nodeName") or ""),
    "spec.restartPolicy": lambda p: str(p.get("spec", {}).get("restartPolicy") or ""),
    "spec.schedulerName": lambda p: str(p.get("spec", {}).get("schedulerName") or ""),
    "spec.serviceAccountName": lambda p: str(p.get("spec", {}).get("serviceAccountName") or ""),
    "spec.hostNetwork": lambda p: "true" if p.get("spec", {}).get("hostNetwork") else "false",
    "status.phase": lambda p: str(p.get("status", {}).get("phase") or ""),
    "status.podIP": lambda p: str(p.get("status", {}).get("podIP") or ""),
    "status.nominatedNodeName": lambda p: str(p.get("status", {}).get("nominatedNodeName") or ""),
}


def _parse_error(message: str) -> ApiError:
    return bad_request(f"unable to parse requirement: {message}")


def validate_label_key(key: str) -> None:
    """Reject keys that are not qualified names (``[prefix/]name``), as labels.Parse does."""
    prefix, _, name = key.rpartition("/")
    if "/" in key and not prefix:
        raise _parse_error(f'Invalid value: "{key}": prefix part must be non-empty')
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        raise _parse_error(f'Invalid value: "{key}": prefix part must be a DNS-1123 subdomain')
    if not name or len(name) > 63 or not _NAME_PART.match(name):
        raise _parse_error(
            f'Invalid value: "{key}": name part must consist of alphanumeric characters, '
            "'-', '_' or '.', and must start and end with an alphanumeric character"
        )


def validate_label_value(value: str) -> None:
    """Reject values that are not valid label values (at most 63 characters, alphanumeric ends)."""
    if len(value) > 63 or not _LABEL_VALUE.match(value):
        raise _parse_error(
            f'Invalid value: "{value}": a valid label must be an empty string or consist of '
            "alphanumeric characters, '-', '_' or '.', and must start and end with an "
            "alphanumeric character"
        )


@dataclass(frozen=True, slots=True)
class Requirement:
    """One label requirement: ``key <operator> values``."""

    key: str
    operator: str  # one of: =, !=, in, notin, exists, !, gt, lt
    values: tuple[str, ...] = ()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Evaluate against a label map with the API server's semantics for absent keys."""
        op = self.operator
        if op == "exists":
            return self.key in labels
        if op == "!":
            return self.key not in labels
        if op in ("=", "in"):
            return self.key in labels and labels[self.key] in self.values
        if op in ("!=", "notin"):
            return self.key not in labels or labels[self.key] not in self.values
        # gt / lt: both sides must parse as integers, otherwise no match.
        if self.key not in labels:
            return False
        try:
            have = int(labels[self.key])
        except ValueError:
            return False
        want = int(self.values[0])
        return have > want if op == "gt" else have < want


def _tokenize(text: str) -> list[str]:
    tokens: list[str] = []
    i, n = 0, len(text)
    while i < n:
        c = text[i]
        if c in " \t\n":
            i += 1
        elif text.startswith(("==", "!="), i):
            tokens.append(text[i : i + 2])
            i += 2
        elif c in "!=(),<>":
            tokens.append(c)
            i += 1
        else:
            j = i
            while j < n and text[j] not in _SPECIAL:
                j += 1
            tokens.append(text[i:j])
            i = j
    return tokens


@dataclass(frozen=True, slots=True)
class LabelSelector:
    """A parsed label selector; the empty selector matches everything."""

    requirements: tuple[Requirement, ...] = ()

    @property
    def empty(self) -> bool:
        """True when the selector selects everything (no requirements)."""
        return not self.requirements

    def matches(self, labels: Mapping[str, str] | None) -> bool:
        """All requirements must hold (selectors are conjunctions)."""
        have = labels or {}
        return all(r.matches(have) for r in self.requirements)

    @classmethod
    def parse(cls, text: str | None) -> LabelSelector:
        """Parse selector text; raise a 400 :class:`ApiError` on syntax errors."""
        if not text or not text.strip():
            return cls()
        tokens = _tokenize(text)
        pos = 0
        reqs: list[Requirement] = []

        def peek() -> str | None:
            return tokens[pos] if pos < len(tokens) else None

        def take() -> str:
            nonlocal pos
            if pos >= len(tokens):
                raise _parse_error(f"found '', expected more in {text!r}")
            tok = tokens[pos]
            pos += 1
            return tok

        while True:
            tok = take()
            if tok == "!":
                key = take()
                validate_label_key(key)
                reqs.append(Requirement(key, "!"))
            else:
                if tok in _SPECIAL or tok in ("==", "!="):
                    raise _parse_error(f"found '{tok}', expected: !, identifier")
                key = tok
                validate_label_key(key)
                nxt = peek()
                if nxt is None or nxt == ",":
                    reqs.append(Requirement(key, "exists"))
                elif nxt in ("=", "==", "!="):
                    take()
                    value = peek()
                    if value is None or value == "," or value in _SPECIAL:
                        value = ""
                    else:
                        take()
                    validate_label_value(value)
                    reqs.append(Requirement(key, "!=" if nxt == "!=" else "=", (value,)))
                elif nxt in ("in", "notin"):
                    take()
                    if take() != "(":
                        raise _parse_error(f"found '{tokens[pos - 1]}', expected: '('")
                    values: list[str] = []
                    expect_value = True
                    while True:
                        item = take()
                        if item == ")":
                            if expect_value and values:
                                values.append("")  # trailing comma: an empty value
                            break
                        if item == ",":
                            if expect_value:
                                values.append("")
                            expect_value = True
                            continue
                        if not expect_value or item in _SPECIAL:
                            raise _parse_error(f"found '{item}', expected: ',', ')'")
                        validate_label_value(item)
                        values.append(item)
                        expect_value = False
                    if not values:
                        raise _parse_error("for 'in', 'notin' operators, values set can't be empty")
                    reqs.append(Requirement(key, nxt, tuple(values)))
                elif nxt in (">", "<"):
                    take()
                    number = take()
                    try:
                        int(number)
                    except ValueError:
                        raise _parse_error(
                            f"for 'Gt', 'Lt' operators, the value must be an integer: {number}"
                        ) from None
                    reqs.append(Requirement(key, "gt" if nxt == ">" else "lt", (number,)))
                else:
                    raise _parse_error(f"found '{nxt}', expected: in, notin, =, ==, !=, gt, lt")
            if peek() is None:
                break
            if take() != ",":
                raise _parse_error(f"found '{tokens[pos - 1]}', expected: ','")
        return cls(tuple(reqs))


@dataclass(frozen=True, slots=True)
class FieldSelector:
    """A parsed pod field selector: a conjunction of ``(field, equal?, value)`` terms."""

    terms: tuple[tuple[str, bool, str], ...] = ()

    @property
    def empty(self) -> bool:
        """True when the selector selects everything."""
        return not self.terms

    def matches(self, pod: Mapping[str, Any]) -> bool:
        """All terms must hold on the pod's selectable fields."""
        return all((POD_FIELDS[name](pod) == value) == equal for name, equal, value in self.terms)

    @classmethod
    def parse(cls, text: str | None) -> FieldSelector:
        """Parse ``f=v,f!=v``; backslash escapes ``\\,``, ``\\=`` and ``\\\\`` in values."""
        if not text or not text.strip():
            return cls()
        terms: list[tuple[str, bool, str]] = []
        for raw in _split_unescaped(text, ","):
            name, equal, value = _parse_field_term(text, raw)
            if name not in POD_FIELDS:
                raise bad_request(f"field label not supported: {name}")
            terms.append((name, equal, value))
        return cls(tuple(terms))


def _parse_field_term(text: str, raw: str) -> tuple[str, bool, str]:
    for op, equal in (("!=", False), ("==", True), ("=", True)):
        idx = _find_unescaped(raw, op)
        if idx >= 0:
            return raw[:idx].strip(), equal, _unescape(raw[idx + len(op) :])
    raise bad_request(f"invalid selector: '{text}'; can't understand '{raw}'")


def _split_unescaped(text: str, sep: str) -> list[str]:
    parts: list[str] = []
    cur: list[str] = []
    i = 0
    while i < len(text):
        if text[i] == "\\" and i + 1 < len(text):
            cur.append(text[i : i + 2])
            i += 2
            continue
        if text[i] == sep:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(text[i])
        i += 1
    parts.append("".join(cur))
    return parts


def _find_unescaped(text: str, needle: str) -> int:
    i = 0
    while i < len(text):
        if text[i] == "\\":
            i += 2
            continue
        if text.startswith(needle, i):
            return i
        i += 1
    return -1


def _unescape(text: str) -> str:
    return re.sub(r"\\(.)", r"\1", text)


@dataclass(frozen=True, slots=True)
class PodFilter:
    """Namespace + label + field selection: what a list or watch request asks for."""

    namespace: str | None = None
    labels: LabelSelector = field(default_factory=LabelSelector)
    fields: FieldSelector = field(default_factory=FieldSelector)

    @property
    def everything(self) -> bool:
        """True when the filter passes every pod in scope (lets lists skip per-pod checks)."""
        return self.labels.empty and self.fields.empty

    def matches(self, pod: Mapping[str, Any]) -> bool:
        """Whether the pod is in scope and satisfies both selectors."""
        meta = pod.get("metadata", {})
        if self.namespace is not None and meta.get("namespace") != self.namespace:
            return False
        return self.labels.matches(meta.get("labels")) and self.fields.matches(pod)
