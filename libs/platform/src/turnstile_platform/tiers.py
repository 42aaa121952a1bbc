"""Sandbox tiers: the one parser of the declared tiers and the default tier (SPEC T2).

Every consumer (the affinity service, the substrate, the CLI) parses the tier
configuration here, so they all accept and refuse exactly the same inputs; the
shared fixture ``tests/fixtures/tiers.json`` pins that, and each consumer's tests
run every case of it through :func:`parse_tiers`.

``TURNSTILE_TIERS`` is a comma-separated list of label values (none: nothing is
filtered, SPEC T6), ``TURNSTILE_DEFAULT_TIER`` one of them (unset: the first; set
without tiers: an error, as it would silently do nothing).
``TURNSTILE_TIER_SETTINGS`` is a JSON object of per-tier ``max_capacity`` (the most
turns a sandbox is credited with, whatever it claims, SPEC O3) and ``shared_pool``
(sessions may use ``native``'s sandboxes, SPEC O2), ``"*"`` for every tier's
defaults; an unknown tier, setting or type is refused naming ``tier_settings``.
The settings are documented in docs/operations.md.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Self

from pydantic import model_validator

from turnstile_clientkeys import MAX_LABEL_VALUE_LENGTH, is_label_value
from turnstile_platform.settings import ServiceSettings

#: The presence and pod label carrying a sandbox's tier (SPEC T1).
TIER_LABEL = "turnstile.dev/tier"

#: More tiers than this is a configuration mistake, not a deployment.
MAX_TIERS = 64

#: The most concurrent turns a sandbox may serve (the Hello's bound, SPEC O3).
MAX_CAPACITY = 1024

#: The ``TURNSTILE_TIER_SETTINGS`` key of every tier's defaults.
EVERY_TIER = "*"


class TierConfigError(ValueError):
    """The tier configuration is invalid; ``field`` names the bad setting
    (``tiers`` or ``default_tier``) and ``detail`` says what is wrong with it."""

    def __init__(self, field: str, detail: str) -> None:
        super().__init__(f"{field}: {detail}")
        self.field = field
        self.detail = detail


class UnknownTierError(ValueError):
    """A request named a tier that is not declared."""


@dataclass(frozen=True)
class TierSettings:
    """What one tier allows (``TURNSTILE_TIER_SETTINGS``)."""

    #: The capacity a sandbox of the tier is credited with at most (SPEC O3).
    max_capacity: int = MAX_CAPACITY
    #: Sessions of the tier may use the ``native`` shared pool (SPEC O2).
    shared_pool: bool = False


_DEFAULT_SETTINGS = TierSettings()


@dataclass(frozen=True)
class TierConfig:
    """Declared tiers and the default tier; no tiers means nothing is filtered."""

    declared: tuple[str, ...] = ()
    default: str | None = None
    #: Per-tier settings by tier name, ``"*"`` for the defaults of every tier.
    settings: Mapping[str, TierSettings] = field(default_factory=dict, hash=False)

    def settings_for(self, tier: str) -> TierSettings:
        """The tier's settings: its own entry, else the ``"*"`` entry, else the defaults."""
        found = self.settings.get(tier) or self.settings.get(EVERY_TIER)
        return found if found is not None else _DEFAULT_SETTINGS

    @property
    def enabled(self) -> bool:
        """Whether tiers filter candidates at all (SPEC T6)."""
        return bool(self.declared)

    def is_declared(self, tier: str) -> bool:
        return tier in self.declared

    def session_tier(self, requested: str) -> str:
        """The tier a request is served in: empty means the default tier.

        With no tiers configured any value is accepted and returned unchanged
        (it filters nothing). Raises :class:`UnknownTierError` for a tier that is
        not declared.
        """
        if not self.enabled:
            return requested
        if not requested:
            assert self.default is not None
            return self.default
        if requested not in self.declared:
            shown = requested if len(requested) <= 63 else f"{requested[:60]}…"
            raise UnknownTierError(
                f"{shown!r} is not a declared tier (declared: {', '.join(self.declared)})"
            )
        return requested


def parse_tiers(
    tiers: str | None, default_tier: str | None = None, tier_settings: str | None = None
) -> TierConfig:
    """Parse ``TURNSTILE_TIERS``, ``TURNSTILE_DEFAULT_TIER`` and
    ``TURNSTILE_TIER_SETTINGS`` (``None`` = unset).

    Raises :class:`TierConfigError` naming the setting and the problem.
    """
    default = (default_tier or "").strip()
    if tiers is None or not tiers.strip():
        if default:
            raise TierConfigError("default_tier", f"{default!r} is set but no tiers are declared")
        return TierConfig(settings=_settings(tier_settings, ()))
    declared = _declared(tiers.split(","))
    settings = _settings(tier_settings, declared)
    if not default:
        return TierConfig(declared, declared[0], settings)
    if default not in declared:
        raise TierConfigError(
            "default_tier",
            f"{default!r} is not a declared tier (declared: {', '.join(declared)})",
        )
    return TierConfig(declared, default, settings)


def _settings(raw: str | None, declared: tuple[str, ...]) -> dict[str, TierSettings]:
    """``TURNSTILE_TIER_SETTINGS``: a JSON object of tier name (or ``"*"``) → settings."""
    if raw is None or not raw.strip():
        return {}
    try:
        doc = json.loads(raw)
    except ValueError:
        raise TierConfigError("tier_settings", "is not valid JSON") from None
    if not isinstance(doc, dict):
        raise TierConfigError("tier_settings", "must be a JSON object of tier name to settings")
    out: dict[str, TierSettings] = {}
    for name, entry in doc.items():
        if name != EVERY_TIER and name not in declared:
            shown = name if len(name) <= 63 else f"{name[:60]}…"
            raise TierConfigError("tier_settings", f"{shown!r} is not '*' or a declared tier")
        if not isinstance(entry, dict):
            raise TierConfigError("tier_settings", f"{name!r}: must be an object")
        unknown = set(entry) - {"max_capacity", "shared_pool"}
        if unknown:
            raise TierConfigError(
                "tier_settings", f"{name!r}: unknown setting {sorted(unknown)[0]!r}"
            )
        capacity = entry.get("max_capacity", MAX_CAPACITY)
        if (
            not isinstance(capacity, int)
            or isinstance(capacity, bool)
            or not 1 <= capacity <= MAX_CAPACITY
        ):
            raise TierConfigError(
                "tier_settings", f"{name!r}: max_capacity must be an integer 1 to {MAX_CAPACITY}"
            )
        shared = entry.get("shared_pool", False)
        if not isinstance(shared, bool):
            raise TierConfigError("tier_settings", f"{name!r}: shared_pool must be true or false")
        out[name] = TierSettings(capacity, shared)
    return out


def _declared(entries: Sequence[str]) -> tuple[str, ...]:
    names: list[str] = []
    for position, entry in enumerate(entries, start=1):
        name = entry.strip()
        if not name:
            raise TierConfigError("tiers", f"entry {position} is empty")
        if not is_label_value(name):
            raise TierConfigError(
                "tiers",
                f"{name!r} is not a valid tier name (a Kubernetes label value: at most "
                f"{MAX_LABEL_VALUE_LENGTH} characters of [A-Za-z0-9._-], starting and "
                "ending with a letter or digit)",
            )
        if name in names:
            raise TierConfigError("tiers", f"{name!r} is listed twice")
        names.append(name)
    if len(names) > MAX_TIERS:
        raise TierConfigError("tiers", f"{len(names)} tiers declared; at most {MAX_TIERS}")
    return tuple(names)


class TieredSettings(ServiceSettings):
    """Settings of a service that knows the tiers (affinity places in them, the
    substrate labels runtimes with them): both read the same variables through the
    one parser, so they agree on what the default tier is."""

    tiers: str | None = None
    """Declared tiers, comma-separated (``container,microvm``). Unset or blank: no
    tiers, nothing is filtered and affinity alone applies (SPEC T6). Parsed by
    :func:`turnstile_platform.tiers.parse_tiers`; invalid values stop start-up."""

    default_tier: str | None = None
    """The tier of a request that names none; unset means the first declared tier."""

    tier_settings: str | None = None
    """Per-tier settings as JSON (``{"container": {"max_capacity": 8, "shared_pool":
    true}}``, ``"*"`` for every tier): the capacity bound of a sandbox (SPEC O3) and
    whether sessions may use the ``native`` shared pool (SPEC O2)."""

    @model_validator(mode="after")
    def _valid_tiers(self) -> Self:
        try:
            parse_tiers(self.tiers, self.default_tier, self.tier_settings)
        except TierConfigError as error:
            raise ValueError(f"TURNSTILE_{error.field.upper()}: {error.detail}") from None
        return self

    @property
    def tier_config(self) -> TierConfig:
        """The parsed tier configuration (validated at start-up)."""
        return parse_tiers(self.tiers, self.default_tier, self.tier_settings)
