"""Node slots (SPEC P4): a cold create needs a free network slot on a candidate node.

Only cold creates are checked (other kinds reuse a pod or a pinned node), and only
when the caller names candidate nodes. Admit takes the first candidate with a free
slot; the slot is the hold's until commit, then the sandbox's until
ReleaseSandbox. An uncommitted slot frees when its hold expires.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from pydantic import Field

from turnstile_admission.policies.base import (
    ActivationShape,
    FailMode,
    Kind,
    Policy,
    PolicyName,
    PolicySettings,
)


class SlotsSettings(PolicySettings):
    """``TURNSTILE_SLOTS__*``."""

    fail: FailMode = FailMode.CLOSED
    """Closed: a node past its network slots fails the pod deep in the node (no IP,
    stuck ContainerCreating) after everything else was spent; a quick retryable
    refusal is better, and only cold creates are affected."""

    default_per_node: int = Field(default=32, ge=0, le=100_000)
    """Slots of a node not named in ``per_node``."""

    per_node: Mapping[str, int] = Field(default_factory=dict)
    """Slots of particular nodes (JSON object, e.g. ``{"node-a": 16}``)."""

    committed_ttl_s: float = Field(default=86_400.0, gt=0, le=30 * 86_400)
    """How long a committed slot lasts without ReleaseSandbox: a backstop so a
    missed release cannot hold a slot for ever. Longer than sandboxes usually run."""

    retry_after_s: float = Field(default=2.0, gt=0, le=3600)
    """Retry hint of a node-slot refusal (sooner when a held slot expires sooner)."""

    def capacity(self, node: str) -> int:
        return self.per_node.get(node, self.default_per_node)


class SlotsPolicy(Policy):
    name: ClassVar[PolicyName] = PolicyName.SLOTS
    hint_capped: ClassVar[bool] = True
    settings: SlotsSettings

    def skip_reason(self, activation: ActivationShape) -> str | None:
        if activation.kind is not Kind.COLD_CREATE:
            return f"not checked for {activation.kind.value}: cold creates only"
        if not activation.candidate_nodes:
            return "no candidate nodes given"
        return None
