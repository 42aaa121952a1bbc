"""What a tier runs on: its pod-template settings (SPEC S1, T6).

A tier is a kind of isolation, not only a label: ``container`` pods run under the cluster's
default runtime, ``microvm`` pods under a sandboxing RuntimeClass (Kata Containers,
Firecracker, gVisor), usually on nodes set aside for it. So each tier names its own
``runtimeClassName``, resources, node selector, tolerations and warm-pool size in
``TURNSTILE_K8S_TIER_RUNTIMES`` (a JSON object, tier → :class:`TierRuntime`).

A field a tier leaves unset takes the substrate-wide value (``cpu_request`` …), so a tier
absent from the object runs exactly the shared template, and has no warm pool. Cold pods and
warm pods of a tier are built from the same resolved template (:mod:`.template`), so a warm
claim hands out what a cold create would have made.

Validation is strict and names the field (``tier_runtimes.microvm.runtime_class_name``):
an unknown key is refused rather than ignored, because a misspelt ``runtimeClassName`` would
otherwise run a microVM tier's untrusted code in plain containers without a word.
"""

from __future__ import annotations

import re
from typing import Any, Literal, Protocol, Self

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

#: A Kubernetes resource quantity (``apimachinery``'s ``resource.Quantity`` grammar).
_QUANTITY = re.compile(
    r"^[+]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|(Ki|Mi|Gi|Ti|Pi|Ei|n|u|m|k|M|G|T|P|E))?$"
)
#: A DNS subdomain (RFC 1123): the name of a RuntimeClass.
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
#: A label key: an optional DNS-subdomain prefix and a name of at most 63 characters.
_LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
_LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9])?$")

#: Most warm pods one tier may keep.
MAX_WARM_POOL_SIZE = 1000


def is_quantity(value: str) -> bool:
    """Whether ``value`` is a Kubernetes resource quantity (``250m``, ``1Gi``, ``2``)."""
    return bool(_QUANTITY.match(value))


def is_label_key(key: str) -> bool:
    """Whether ``key`` is a valid label key (``kubernetes.io/arch``, ``pool``)."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix)):
        return False
    return bool(_LABEL_NAME.match(name))


def check_quantity(value: str | None) -> str | None:
    """``value`` if it is empty, unset or a quantity; else a ValueError saying so."""
    if value and not is_quantity(value):
        raise ValueError(f"{value!r} is not a Kubernetes quantity (like 250m, 512Mi, 2)")
    return value


class Toleration(BaseModel):
    """One ``tolerations`` entry of a tier's pods (the Kubernetes fields, snake_case)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    key: str = ""
    """The taint key; empty with ``operator: Exists`` tolerates every taint."""

    operator: Literal["Equal", "Exists"] = "Equal"
    value: str = ""
    """The taint value (``Equal`` only; ``Exists`` must leave it empty)."""

    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""
    """Empty tolerates every effect."""

    toleration_seconds: int | None = Field(default=None, ge=0)
    """``NoExecute`` only: how long the pod stays bound after the taint appears."""

    @field_validator("key")
    @classmethod
    def _key(cls, value: str) -> str:
        if value and not is_label_key(value):
            raise ValueError(f"{value!r} is not a valid taint key")
        return value

    @model_validator(mode="after")
    def _consistent(self) -> Self:
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value")
        if not self.key and self.operator != "Exists":
            raise ValueError("an empty key needs operator Exists")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("toleration_seconds needs effect NoExecute")
        return self

    def manifest(self) -> dict[str, Any]:
        """The toleration as the pod spec spells it (camelCase, empty fields left out)."""
        out: dict[str, Any] = {"operator": self.operator}
        if self.key:
            out["key"] = self.key
        if self.value:
            out["value"] = self.value
        if self.effect:
            out["effect"] = self.effect
        if self.toleration_seconds is not None:
            out["tolerationSeconds"] = self.toleration_seconds
        return out


class TierRuntime(BaseModel):
    """The pod template of one tier; unset fields take the substrate-wide settings."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    runtime_class_name: str | None = Field(default=None, max_length=253)
    """``runtimeClassName`` of the tier's pods (a RuntimeClass such as ``kata`` or
    ``gvisor``); unset: the cluster's default runtime."""

    cpu_request: str | None = None
    """CPU request of the runtime container; unset: ``TURNSTILE_K8S_CPU_REQUEST``; empty:
    none."""

    memory_request: str | None = None
    """Memory request; unset: ``TURNSTILE_K8S_MEMORY_REQUEST``; empty: none."""

    cpu_limit: str | None = None
    """CPU limit; unset: ``TURNSTILE_K8S_CPU_LIMIT``; empty: none."""

    memory_limit: str | None = None
    """Memory limit; unset: ``TURNSTILE_K8S_MEMORY_LIMIT``; empty: none. A microVM's guest
    memory is sized from it by Kata, so set it for such a tier."""

    node_selector: dict[str, str] = Field(default_factory=dict)
    """``nodeSelector`` of the tier's pods (nodes that have its runtime installed)."""

    tolerations: tuple[Toleration, ...] = ()
    """``tolerations`` of the tier's pods (the taints of the nodes set aside for it)."""

    warm_pool_size: int = Field(default=0, ge=0, le=MAX_WARM_POOL_SIZE)
    """Warm pods the leader keeps for the tier; 0: no warm pool, every activation there is
    a cold create. With ``warm_autosize`` it is the size used until the leader has
    measured demand, and the autosizer's bounds are ``warm_min``..``warm_max``."""

    warm_autosize: bool = False
    """Size the pool from demand (SPEC W1, :mod:`.warm_sizing`) instead of
    ``warm_pool_size``."""

    warm_min: int = Field(default=0, ge=0, le=MAX_WARM_POOL_SIZE)
    """Fewest warm pods the autosizer keeps (also when demand stops)."""

    warm_max: int = Field(default=50, ge=0, le=MAX_WARM_POOL_SIZE)
    """Most warm pods the autosizer keeps."""

    warm_headroom: float = Field(default=1.2, ge=1.0, le=10.0)
    """Multiplies the autosizer's ``demand × ready time``."""

    @model_validator(mode="after")
    def _autosize_bounds(self) -> Self:
        if self.warm_min > self.warm_max:
            raise ValueError("warm_min must not exceed warm_max")
        return self

    @field_validator("runtime_class_name")
    @classmethod
    def _runtime_class(cls, value: str | None) -> str | None:
        if value is not None and not _DNS_SUBDOMAIN.match(value):
            raise ValueError(f"{value!r} is not a RuntimeClass name (a DNS subdomain)")
        return value

    @field_validator("cpu_request", "memory_request", "cpu_limit", "memory_limit")
    @classmethod
    def _quantity(cls, value: str | None) -> str | None:
        return check_quantity(value)

    @field_validator("node_selector")
    @classmethod
    def _node_selector(cls, value: dict[str, str]) -> dict[str, str]:
        for key, label in value.items():
            if not is_label_key(key):
                raise ValueError(f"{key!r} is not a valid label key")
            if not _LABEL_VALUE.match(label):
                raise ValueError(f"{key!r}: {label!r} is not a valid label value")
        return value

    def resources(self, settings: SharedTemplate) -> dict[str, dict[str, str]]:
        """The runtime container's ``resources``: this tier's values over the shared ones,
        empty ones left out."""
        requests = _quantities(
            cpu=_pick(self.cpu_request, settings.cpu_request),
            memory=_pick(self.memory_request, settings.memory_request),
        )
        limits = _quantities(
            cpu=_pick(self.cpu_limit, settings.cpu_limit),
            memory=_pick(self.memory_limit, settings.memory_limit),
        )
        return {
            part: values for part, values in (("requests", requests), ("limits", limits)) if values
        }

    def scheduling(self) -> dict[str, Any]:
        """The pod-spec fields that choose the runtime and the nodes (none when unset)."""
        spec: dict[str, Any] = {}
        if self.runtime_class_name is not None:
            spec["runtimeClassName"] = self.runtime_class_name
        if self.node_selector:
            spec["nodeSelector"] = dict(self.node_selector)
        if self.tolerations:
            spec["tolerations"] = [toleration.manifest() for toleration in self.tolerations]
        return spec


class SharedTemplate(Protocol):
    """The substrate-wide resource settings a tier falls back to (``KubernetesSettings``)."""

    cpu_request: str
    memory_request: str
    cpu_limit: str
    memory_limit: str


def _pick(tier_value: str | None, shared: str) -> str:
    return shared if tier_value is None else tier_value


def _quantities(**values: str) -> dict[str, str]:
    return {name: value for name, value in values.items() if value}
