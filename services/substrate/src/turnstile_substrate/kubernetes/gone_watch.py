"""A pod deleted outside Turnstile ends its sandbox's execution at once (SPEC S3, F4).

``kubectl delete``, an eviction, a node drained or lost, a runtime that exits: the sandbox's
pod goes, but its execution row stays open until something notices. The gone-runtimes sweep
(:mod:`.sweeps`) notices at its next pass, up to ``sweep_interval_s`` (30 s) later; meanwhile
the sandbox reads as running and its admission slot stays held.

This is the prompt path. The reflector's index reports every sandbox pod that stops being live
— deleted, terminating, finished, relabelled, or missing from a re-list — and the **leader**
(leader-only work ``gone-runtimes``, so replicas do not race to end one row) ends the row of
each that is still the sandbox's active execution, through the sweep's own code
(:meth:`.Sweeper.end_if_recorded`), under the sandbox's activation claim: the API server
confirms the pod is gone, a sandbox with another live pod keeps its record on that pod, and
the admission slot is released. Ending is idempotent (``end_runtime`` ends only the execution
that still names the pod), so a row a Deactivate or an activation already ended (the claim
makes the watch wait for them), or a pod seen to go twice, changes nothing.

Pods seen to go while this replica is not the leader are not queued: the next leader's first
sweep pass, which runs as soon as it leads, covers them.
"""

from __future__ import annotations

import asyncio
import logging

from turnstile_platform.leader import LeaderTerm
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.podinfo import PodInfo
from turnstile_substrate.kubernetes.sweeps import Sweeper

log = logging.getLogger(__name__)


class GoneRuntimeWatch:
    """Leader-only work: end the execution row of each sandbox pod the reflector sees go."""

    def __init__(self, index: PodIndex, sweeper: Sweeper, synced: asyncio.Event) -> None:
        self._index = index
        self._sweeper = sweeper
        self._synced = synced
        #: pods seen to go, not handled yet: pod name → sandbox id (a pod seen twice once)
        self._gone: dict[str, str] = {}
        self._wake = asyncio.Event()
        #: set while the watch is on (this replica leads and its reflector has synced)
        self.watching = asyncio.Event()

    def _seen(self, pod: PodInfo) -> None:
        if pod.sandbox_id is not None:
            self._gone[pod.name] = pod.sandbox_id
            self._wake.set()

    async def run(self, term: LeaderTerm) -> None:
        """Handle gone pods while this replica leads (cancelled when it stops)."""
        await self._synced.wait()
        log.info("gone-runtime watch starts (leader epoch %d)", term.epoch)
        self._index.on_runtime_gone = self._seen
        self.watching.set()
        try:
            while True:
                await self._wake.wait()
                self._wake.clear()
                while self._gone:
                    name = next(iter(self._gone))
                    sandbox_id = self._gone.pop(name)
                    await self._sweeper.end_if_recorded(sandbox_id, name)
        finally:
            self.watching.clear()
            self._index.on_runtime_gone = None
            self._gone.clear()
