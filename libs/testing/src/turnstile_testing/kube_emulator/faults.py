"""Injected failures: "the next N requests matching X fail with status S".

Production code must survive 409s on a contended PATCH, 500s, 429s and 410s; these rules let a
test produce exactly one of those at exactly the request it cares about, then get out of the way.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field

from turnstile_testing.kube_emulator.errors import DEFAULT_REASONS, ApiError

PathMatcher = str | re.Pattern[str] | Callable[[str], bool] | None


@dataclass(eq=False)
class Fault:
    """One injection rule; ``hits`` counts the requests it failed so far.

    ``path`` is a regular expression that must match the whole request path (a plain path such as
    ``/api/v1/namespaces/ns/pods/p`` matches itself), a compiled pattern, or a predicate. ``watch``
    restricts the rule to watch requests (True) or to everything else (False).
    """

    status: int
    method: str | None = None
    path: PathMatcher = None
    times: int = 1
    reason: str | None = None
    message: str | None = None
    watch: bool | None = None
    hits: int = 0
    _pattern: re.Pattern[str] | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if isinstance(self.path, str):
            self._pattern = re.compile(self.path)
        elif isinstance(self.path, re.Pattern):
            self._pattern = self.path

    @property
    def remaining(self) -> int:
        """How many more matching requests this rule will fail."""
        return max(0, self.times - self.hits)

    def matches(self, method: str, path: str, is_watch: bool) -> bool:
        """Whether the rule applies to this request (ignores ``remaining``)."""
        if self.method is not None and self.method.upper() != method.upper():
            return False
        if self.watch is not None and self.watch != is_watch:
            return False
        if self._pattern is not None:
            return self._pattern.fullmatch(path) is not None
        if callable(self.path):
            return bool(self.path(path))
        return True

    def error(self, path: str) -> ApiError:
        """The error this rule answers with."""
        reason = self.reason if self.reason is not None else DEFAULT_REASONS.get(self.status, "")
        message = self.message or f"injected failure ({self.status} {reason}) for {path}"
        return ApiError(self.status, message, reason)


class FaultInjector:
    """The active rules, consulted in order for every request."""

    def __init__(self) -> None:
        self.rules: list[Fault] = []

    def add(self, fault: Fault) -> Fault:
        """Install a rule; it removes itself once it has fired ``times`` times."""
        self.rules.append(fault)
        return fault

    def clear(self) -> None:
        """Remove every rule."""
        self.rules.clear()

    def take(self, method: str, path: str, is_watch: bool) -> ApiError | None:
        """If a rule matches, consume one of its shots and return its error."""
        for fault in self.rules:
            if fault.remaining and fault.matches(method, path, is_watch):
                fault.hits += 1
                if not fault.remaining:
                    self.rules.remove(fault)
                return fault.error(path)
        return None
