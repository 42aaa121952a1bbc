"""The ``Substrate`` interface (SPEC S1) and the values that cross it.

Two implementations: Kubernetes (pods, a reflector, a warm pool) and Direct
(host processes, the embedded default). The Activate orchestration
(:mod:`turnstile_substrate.activation`) is written once against this interface:
it asks the substrate for a plan, asks admission, then has the substrate make the
runtime exist, and records the attribution.
"""

from __future__ import annotations

import enum
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from turnstile_clientkeys.live_store import LiveStore
    from turnstile_platform.leader import LeaderTerm

#: Pod label keys (SPEC S2). The client-id label is set at creation, never changed.
LABEL_SANDBOX_ID = "turnstile.dev/sandbox-id"
LABEL_CLIENT_ID = "turnstile.dev/client-id"
LABEL_TIER = "turnstile.dev/tier"
LABEL_POOL = "turnstile.dev/pool"
#: On warm pods: a hash of the spec their tier's template gave them (a claim takes only
#: warm pods made from the current one).
LABEL_TEMPLATE = "turnstile.dev/template"
#: On pods the warm pool made: ``warm-pool``, set at creation and kept by the adoption
#: patch, so a sandbox pod says it was a warm hit however late the reflector first saw it.
LABEL_ORIGIN = "turnstile.dev/origin"
LABEL_MANAGED_BY = "app.kubernetes.io/managed-by"
MANAGED_BY = "turnstile"
#: Every sandbox pod is ``app.kubernetes.io/name=turnstile-worker``: the label the
#: NetworkPolicies (deploy/kustomize) select sandbox pods by.
LABEL_NAME = "app.kubernetes.io/name"
WORKER_NAME = "turnstile-worker"


class CreateKind(enum.Enum):
    """How a runtime will be made to exist (maps to ``ActivationKind``)."""

    COLD = "cold"
    WARM = "warm"
    RESTORE = "restore"
    RESUME = "resume"


@dataclass(frozen=True)
class RuntimeSpec:
    """What the orchestration asks a substrate to run."""

    sandbox_id: str
    tier: str
    #: Value of the ``turnstile.dev/client-id`` label and of the record; None = NULL/no label.
    client_label: str | None
    #: True when a stopped sandbox's workspace is restored.
    restore: bool = False
    #: Which activation of the sandbox this is (its executions so far). A retried or
    #: concurrent activation computes the same one, so a substrate that names runtimes
    #: from it makes one runtime per activation (SPEC F5).
    generation: int = 0


@dataclass(frozen=True)
class Plan:
    """What the substrate intends to do, so admission can be asked first."""

    kind: CreateKind
    #: Nodes a cold create may land on (node-slot policy); empty when not applicable.
    candidate_nodes: tuple[str, ...] = ()


@dataclass(frozen=True)
class Runtime:
    """A runtime that exists: a pod or a process."""

    sandbox_id: str
    name: str
    kind: CreateKind
    client_label: str | None
    tier: str
    node: str = ""
    endpoint: str = ""
    #: A warm pod whose creation admission's ReserveWarm already paid: its claim's
    #: cluster-bucket token goes back when the hold is committed (SPEC W3).
    creation_paid: bool = False


@dataclass(frozen=True)
class LiveCount:
    """A known live count for a bounded key."""

    live: int
    live_pending: frozenset[str] = field(default_factory=frozenset)


@dataclass(frozen=True)
class CountUnknown:
    """The count cannot be given; admission then admits (SPEC S4)."""

    reason: str  # "unsupported" | "not_synced"
    detail: str = ""


#: Runs the cap before a pod is created (SPEC S5); raises when the cap forbids it.
CapGate = Callable[[], Awaitable[None]]


class Substrate(Protocol):
    """One way of running sandbox runtimes."""

    name: str

    async def start(self) -> None:
        """Start background work (reflector, warm pool); return once started."""

    async def close(self) -> None:
        """Stop background work and release connections."""

    def ready(self) -> bool:
        """Whether it can serve (Kubernetes: the reflector's first list synced)."""

    async def find_running(self, sandbox_id: str) -> Runtime | None:
        """The sandbox's runtime if it is already running (never refused: SPEC S5)."""

    def plan(self, spec: RuntimeSpec) -> Plan:
        """Which kind of create ``ensure_runtime`` will attempt first."""

    async def ensure_runtime(self, spec: RuntimeSpec, plan: Plan, cap_gate: CapGate) -> Runtime:
        """Make the runtime exist. Runs ``cap_gate`` before every pod it creates.

        On failure it leaves nothing behind (deletes what it created) and raises.
        """

    async def stop_runtime(self, sandbox_id: str) -> bool:
        """Stop the runtime (delete the pod / stop the process); False if none ran."""

    def count_live(
        self, key: str, exclude_sandbox_id: str | None, pending: Collection[str]
    ) -> LiveCount | CountUnknown:
        """O(1) live count of a bounded key's other sandboxes (SPEC S4)."""

    def key_set_changed(self) -> None:
        """A new key set was installed: live sandboxes may now belong to other
        bounded keys, so the live counts should be published again soon."""

    def live_counts_work(
        self, store: LiveStore, chunk: int
    ) -> Callable[[LeaderTerm], Awaitable[None]]:
        """Leader-only work that keeps the live counts admission reads in ``store``
        (SPEC S4): the reflector's live sandboxes, or, for a substrate that cannot
        count, the marker that says so. Called once the substrate has started."""
