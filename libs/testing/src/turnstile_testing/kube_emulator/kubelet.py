"""A small scheduler and kubelet for the emulator: what moves pods along in a real cluster.

Without it pods stay ``Pending`` with no node until a test patches them. With it (opt-in,
``KubeEmulator(kubelet=KubeletConfig(...))``) every pod written to the store is followed:

* **scheduling** — a pod with no ``spec.nodeName`` is bound to the next node (round robin)
  after ``schedule_delay``;
* **starting** — a scheduled ``Pending`` pod becomes ``Running`` and Ready after
  ``start_delay`` (``status.startTime``, ``podIP``, ``hostIP``, conditions, container statuses);
* **stopping** — a Terminating pod (graceful deletion) is removed after its containers stop:
  ``stop_delay``, capped by its grace period;
* **failing on demand** — :func:`mark_failed` (``KubeEmulator.fail_pod``) puts a pod in
  ``Failed`` as an exited container or an eviction does.

Each step re-reads the pod, so a pod deleted or changed meanwhile is left as it is. Writes go
through the store's back door (:meth:`PodStore.mutate`), as the scheduler's binding and the
kubelet's status updates use paths clients cannot.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from dataclasses import dataclass
from typing import Any

from turnstile_platform.background import BackgroundTasks
from turnstile_testing.kube_emulator.errors import ApiError
from turnstile_testing.kube_emulator.store import DELETED, Event, PodStore, now_rfc3339


@dataclass(frozen=True)
class KubeletConfig:
    """Timing of the emulated scheduler and kubelet (seconds)."""

    nodes: tuple[str, ...] = ("node-1", "node-2", "node-3")
    schedule_delay: float = 0.0
    start_delay: float = 0.05
    stop_delay: float = 0.05


def mark_running(pod: dict[str, Any]) -> None:
    """Status of a pod whose containers all started and are ready."""
    now = now_rfc3339()
    spec = pod.get("spec") or {}
    status = pod.setdefault("status", {})
    status.update(
        phase="Running",
        startTime=status.get("startTime") or now,
        hostIP="192.0.2.1",
        podIP=f"198.51.100.{abs(hash(pod['metadata']['name'])) % 250 + 1}",
        conditions=[
            {"type": kind, "status": "True", "lastTransitionTime": now}
            for kind in ("PodScheduled", "Initialized", "ContainersReady", "Ready")
        ],
        containerStatuses=[
            {
                "name": c.get("name", ""),
                "image": c.get("image", ""),
                "ready": True,
                "started": True,
                "restartCount": 0,
                "state": {"running": {"startedAt": now}},
            }
            for c in spec.get("containers") or []
        ],
    )


def mark_failed(pod: dict[str, Any], reason: str = "Error", message: str = "") -> None:
    """Status of a pod whose containers exited with an error (or that was evicted)."""
    now = now_rfc3339()
    spec = pod.get("spec") or {}
    status = pod.setdefault("status", {})
    status.update(phase="Failed", reason=reason)
    if message:
        status["message"] = message
    status["conditions"] = [
        c for c in status.get("conditions") or [] if c.get("type") not in ("Ready",)
    ] + [{"type": "Ready", "status": "False", "lastTransitionTime": now, "reason": reason}]
    status["containerStatuses"] = [
        {
            "name": c.get("name", ""),
            "image": c.get("image", ""),
            "ready": False,
            "started": False,
            "restartCount": 0,
            "state": {"terminated": {"exitCode": 1, "reason": reason, "finishedAt": now}},
        }
        for c in spec.get("containers") or []
    ]


class Kubelet:
    """Follows the store's events and moves pods through their lifecycle."""

    def __init__(self, store: PodStore, config: KubeletConfig) -> None:
        if not config.nodes:
            raise ValueError("the kubelet needs at least one node")
        self._store = store
        self._config = config
        self._nodes = itertools.cycle(config.nodes)
        self._steps = BackgroundTasks("kube emulator kubelet")
        #: pods with a step scheduled, so one event burst schedules one step
        self._pending: set[tuple[str, str, str]] = set()

    def start(self) -> None:
        self._store.add_observer(self._on_event)
        for pod in self._store.all():
            self._follow(pod.obj)

    async def stop(self) -> None:
        self._store.remove_observer(self._on_event)
        await self._steps.close()

    def _on_event(self, event: Event) -> None:
        if event.type != DELETED:
            self._follow(event.pod.obj)

    def _follow(self, pod: dict[str, Any]) -> None:
        meta = pod["metadata"]
        key = (meta["namespace"], meta["name"])
        spec = pod.get("spec") or {}
        phase = (pod.get("status") or {}).get("phase")
        if meta.get("deletionTimestamp"):
            grace = meta.get("deletionGracePeriodSeconds") or 0
            if grace > 0:
                self._later("stop", key, min(self._config.stop_delay, float(grace)))
        elif not spec.get("nodeName"):
            self._later("schedule", key, self._config.schedule_delay)
        elif phase == "Pending":
            self._later("start", key, self._config.start_delay)

    def _later(self, step: str, key: tuple[str, str], delay: float) -> None:
        marker = (step, *key)
        if marker in self._pending:
            return
        self._pending.add(marker)
        self._steps.spawn(self._step(step, key, delay), name=f"{step} {key[0]}/{key[1]}")

    async def _step(self, step: str, key: tuple[str, str], delay: float) -> None:
        try:
            await asyncio.sleep(delay)
        finally:
            self._pending.discard((step, *key))
        with contextlib.suppress(ApiError):  # gone meanwhile
            if step == "stop":
                self._store.finish_termination(*key)
            elif step == "schedule":
                self._store.mutate(*key, self._bind)
            elif step == "start":
                self._store.mutate(*key, _start)

    def _bind(self, pod: dict[str, Any]) -> None:
        if pod["metadata"].get("deletionTimestamp") or (pod.get("spec") or {}).get("nodeName"):
            return
        pod.setdefault("spec", {})["nodeName"] = next(self._nodes)
        status = pod.setdefault("status", {})
        status["conditions"] = [
            c for c in status.get("conditions") or [] if c.get("type") != "PodScheduled"
        ] + [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now_rfc3339()}]


def _start(pod: dict[str, Any]) -> None:
    if pod["metadata"].get("deletionTimestamp"):
        return
    if (pod.get("status") or {}).get("phase") != "Pending":
        return
    if not (pod.get("spec") or {}).get("nodeName"):
        return
    mark_running(pod)
