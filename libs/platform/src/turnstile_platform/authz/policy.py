"""The authorization policy: which identities may call which methods, for which clients.

The file is TOML: ``[[allow]]`` rules of ``identities`` (exact SPIFFE IDs, ``…/*``
prefixes or ``*``), ``methods`` (``package.Service/Method``, ``…/*`` or ``*``; every
name must exist in the contracts, so a typo is an invalid file, not a silent deny)
and, for the methods that act for a client (:mod:`turnstile_platform.authz.methods`),
``clients``: ``"any"``, ``"self"`` (the client a ``self`` identity template with one
``{client}`` segment reads from the caller; a template never yields a reserved
client id, SPEC O5) or a list. Default deny, fail closed: rules add up, none
subtracts, and a rule without ``clients`` grants only methods that act for none.

Decisions are compiled once per (identity, method) and cached on the policy
object, so the check on the hot path is a dict lookup; a reload builds a new
policy with an empty cache. The file's format, with examples, is in
docs/security.md.
"""

from __future__ import annotations

import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from turnstile_clientkeys import RESERVED_IDS
from turnstile_platform.identity import parse_spiffe_id

ANY = "any"
SELF = "self"
CLIENT_PLACEHOLDER = "{client}"
OTHER_LABEL = "other"
_CACHE_LIMIT = 8192


class PolicyError(ValueError):
    """The policy file is invalid; the message names the rule and the field."""


@dataclass(frozen=True)
class AuthzDecision:
    """What one identity may do with one method."""

    allowed: bool
    any_client: bool = False
    clients: frozenset[str] = frozenset()
    label: str = OTHER_LABEL
    """The metric label of the identity: the policy's name for it, or ``other``."""

    def allows_client(self, client_id: str | None) -> bool:
        if self.any_client:
            return True
        return client_id is not None and client_id in self.clients


@dataclass(frozen=True)
class SelfTemplate:
    """``spiffe://td/…/{client}/…``: which one path segment of an identity names
    its own client."""

    text: str
    prefix: str
    suffix: str

    @classmethod
    def parse(cls, text: object, where: str) -> SelfTemplate:
        if not isinstance(text, str):
            raise PolicyError(f"{where}: expected a string such as {_EXAMPLE!r}")
        if text.count(CLIENT_PLACEHOLDER) != 1:
            raise PolicyError(f"{where}: {text!r} must hold {CLIENT_PLACEHOLDER} exactly once")
        prefix, _, suffix = text.partition(CLIENT_PLACEHOLDER)
        if not prefix.endswith("/") or not (suffix == "" or suffix.startswith("/")):
            raise PolicyError(
                f"{where}: {text!r}: {CLIENT_PLACEHOLDER} must be a whole path segment"
            )
        try:
            parse_spiffe_id(prefix + "x" + suffix)
        except ValueError as error:
            raise PolicyError(f"{where}: {error}") from None
        return cls(text, prefix, suffix)

    def client_of(self, identity: str) -> str | None:
        """The one segment ``{client}`` stands for in ``identity`` (None: no match).

        ``identity`` is a valid SPIFFE ID (:func:`~turnstile_platform.identity.peer_identity`
        checked it), so a segment is non-empty and holds no ``/``."""
        if not identity.startswith(self.prefix) or not identity.endswith(self.suffix):
            return None
        client = identity[len(self.prefix) : len(identity) - len(self.suffix)]
        if not client or "/" in client or client in RESERVED_IDS:
            return None
        return client


_EXAMPLE = "spiffe://turnstile.local/client/{client}"


@dataclass(frozen=True)
class _Rule:
    exact: frozenset[str]
    prefixes: tuple[str, ...]
    wildcard: bool
    methods_exact: frozenset[str]
    services: frozenset[str]
    all_methods: bool
    any_client: bool
    self_template: SelfTemplate | None
    clients: frozenset[str]

    def identity_label(self, identity: str) -> str | None:
        if identity in self.exact:
            return identity
        for prefix in self.prefixes:
            if identity.startswith(prefix):
                return prefix + "*"
        if self.wildcard:
            return "*"
        return None

    def names(self, method: str) -> bool:
        if self.all_methods or method in self.methods_exact:
            return True
        return method.rpartition("/")[0] in self.services


@dataclass
class AuthzPolicy:
    """A compiled policy. :meth:`decide` is cheap after the first call per pair."""

    rules: tuple[_Rule, ...]
    source: str = ""
    _cache: dict[tuple[str, str], AuthzDecision] = field(default_factory=dict, repr=False)

    @property
    def labels(self) -> frozenset[str]:
        """Every identity label this policy can produce (bounded metric cardinality)."""
        out = {OTHER_LABEL}
        for rule in self.rules:
            out |= rule.exact
            out |= {p + "*" for p in rule.prefixes}
            if rule.wildcard:
                out.add("*")
        return frozenset(out)

    def decide(self, identity: str, method: str) -> AuthzDecision:
        """The decision for ``identity`` calling ``method`` (``/pkg.Service/Method``
        or ``pkg.Service/Method``)."""
        key = (identity, method)
        found = self._cache.get(key)
        if found is not None:
            return found
        decision = self._compute(identity, method.lstrip("/"))
        if len(self._cache) >= _CACHE_LIMIT:
            self._cache.clear()
        self._cache[key] = decision
        return decision

    def _compute(self, identity: str, method: str) -> AuthzDecision:
        allowed = False
        any_client = False
        clients: set[str] = set()
        label: str | None = None
        for rule in self.rules:
            matched = rule.identity_label(identity)
            if matched is None:
                continue
            if label is None or (label != identity and matched == identity):
                label = matched
            if not rule.names(method):
                continue
            allowed = True
            any_client = any_client or rule.any_client
            clients |= rule.clients
            if rule.self_template is not None:
                own = rule.self_template.client_of(identity)
                if own is not None:
                    clients.add(own)
        return AuthzDecision(allowed, any_client, frozenset(clients), label or OTHER_LABEL)


def _strings(value: object, where: str) -> list[str]:
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) and v for v in value):
        return list(value)
    raise PolicyError(f"{where}: expected a non-empty string or list of strings")


def _rule(
    raw: Mapping[str, Any],
    index: int,
    known_methods: frozenset[str] | None,
    default_self: SelfTemplate | None = None,
) -> _Rule:
    where = f"allow[{index}]"
    unknown = set(raw) - {"identities", "methods", "clients", "comment", SELF}
    if unknown:
        raise PolicyError(f"{where}: unknown keys {sorted(unknown)}")
    exact: set[str] = set()
    prefixes: list[str] = []
    wildcard = False
    for pattern in _strings(raw.get("identities"), f"{where}.identities"):
        if pattern == "*":
            wildcard = True
            continue
        prefix = pattern.endswith("/*")
        if "*" in (pattern[:-2] if prefix else pattern):
            raise PolicyError(f"{where}.identities: {pattern!r}: '*' only as a last path segment")
        try:
            parse_spiffe_id(pattern[:-2] if prefix else pattern)
        except ValueError as error:
            raise PolicyError(f"{where}.identities: {error}") from None
        if prefix:
            prefixes.append(pattern[:-1])
        else:
            exact.add(pattern)
    methods_exact: set[str] = set()
    services: set[str] = set()
    all_methods = False
    known_services = {m.rpartition("/")[0] for m in known_methods or ()}
    for method in _strings(raw.get("methods"), f"{where}.methods"):
        method = method.lstrip("/")
        if method == "*":
            all_methods = True
        elif method.endswith("/*"):
            service = method[:-2]
            if known_methods is not None and service not in known_services:
                raise PolicyError(f"{where}.methods: no service {service!r}")
            services.add(service)
        else:
            if known_methods is not None and method not in known_methods:
                raise PolicyError(f"{where}.methods: no method {method!r}")
            methods_exact.add(method)
    clients_raw = raw.get("clients", [])
    any_client = False
    template: SelfTemplate | None = None
    clients: set[str] = set()
    if SELF in raw:
        template = SelfTemplate.parse(raw[SELF], f"{where}.{SELF}")
        if clients_raw != SELF:
            raise PolicyError(f'{where}.{SELF}: a template is only for clients = "self"')
    if clients_raw == ANY:
        any_client = True
    elif clients_raw == SELF:
        template = template or default_self
        if template is None:
            raise PolicyError(
                f'{where}.clients: "self" needs an identity template naming the client '
                f'segment: {SELF} = "{_EXAMPLE}" at the top of the file (or in the rule)'
            )
    elif isinstance(clients_raw, list) and all(isinstance(c, str) and c for c in clients_raw):
        clients = set(clients_raw)
    else:
        raise PolicyError(f'{where}.clients: expected "any", "self" or a list of client ids')
    return _Rule(
        frozenset(exact),
        tuple(prefixes),
        wildcard,
        frozenset(methods_exact),
        frozenset(services),
        all_methods,
        any_client,
        template,
        frozenset(clients),
    )


def parse_policy(
    text: str, *, source: str = "", known_methods: Iterable[str] | None = None
) -> AuthzPolicy:
    """Parse and compile a policy; :class:`PolicyError` names what is wrong."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise PolicyError(f"not valid TOML: {error}") from None
    unknown = set(data) - {"allow", SELF}
    if unknown:
        raise PolicyError(
            f"unknown top-level keys {sorted(unknown)} (expected {SELF} and [[allow]] rules)"
        )
    default_self = SelfTemplate.parse(data[SELF], SELF) if SELF in data else None
    raw_rules = data.get("allow", [])
    if not isinstance(raw_rules, list) or not all(isinstance(r, dict) for r in raw_rules):
        raise PolicyError("allow: expected an array of tables ([[allow]])")
    known = frozenset(m.lstrip("/") for m in known_methods) if known_methods is not None else None
    rules = tuple(_rule(raw, i, known, default_self) for i, raw in enumerate(raw_rules))
    return AuthzPolicy(rules, source)


def load_policy(path: Path, *, known_methods: Iterable[str] | None = None) -> AuthzPolicy:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise PolicyError(f"cannot read {path}: {error}") from None
    return parse_policy(text, source=str(path), known_methods=known_methods)


ALLOW_ALL = AuthzPolicy((_rule({"identities": "*", "methods": "*", "clients": ANY}, 0, None),), "")
"""Every authenticated identity may do everything (plaintext development and tests)."""
