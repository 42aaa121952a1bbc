"""Keeps the live policy: loaded at start, reloaded when the file changes (SPEC Z2).

Every replica polls the file's ``stat`` signature every
``authz_poll_interval_s`` (0.5 s by default), so a change reaches every replica
within a second. ``stat`` follows symlinks, so the atomic symlink swap of a
Kubernetes ConfigMap volume counts as a change. The job runs on every replica
(each enforces its own copy).

An invalid file at start fails start-up. An invalid file later keeps the last
good policy and says so: a warning log line naming the problem, the
``turnstile_authz_policy_reloads_total{result="error"}`` counter, the
``turnstile_authz_policy_valid`` gauge at 0, and the health service name
``turnstile.authz.Policy`` reporting NOT_SERVING (the server's overall status
is left alone: a bad ConfigMap on every replica must not take the fleet out of
rotation while the last good policy keeps enforcing).
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Callable, Iterable
from pathlib import Path

from prometheus_client import Counter, Gauge

from turnstile_platform.authz.policy import AuthzPolicy, PolicyError, load_policy
from turnstile_platform.background import BackgroundTasks

log = logging.getLogger(__name__)

#: The health service name that reports whether the policy file on disk is valid.
POLICY_HEALTH_NAME = "turnstile.authz.Policy"

RELOADS = Counter(
    "turnstile_authz_policy_reloads_total",
    "Policy file loads after a change, by result (ok, error).",
    ["result"],
)
VALID = Gauge(
    "turnstile_authz_policy_valid",
    "1 when the policy file on disk is the one enforced, 0 when it is invalid and the "
    "last good policy is kept.",
)

Signature = tuple[int, int, int]
OnValidity = Callable[[bool], object]


def _signature(path: Path) -> Signature | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


class PolicyWatcher:
    """The current policy, and the task that reloads it."""

    def __init__(
        self,
        path: Path,
        *,
        poll_interval_s: float,
        known_methods: Iterable[str] | None = None,
    ) -> None:
        self.path = path
        self.poll_interval_s = poll_interval_s
        self.known_methods = frozenset(known_methods) if known_methods is not None else None
        self._signature = _signature(path)
        self.policy: AuthzPolicy = load_policy(path, known_methods=self.known_methods)
        self.valid = True
        self.last_error: str | None = None
        self._listeners: list[OnValidity] = []
        # Runs on every replica: each enforces the policy file it reads.
        self._watching = BackgroundTasks("authz policy watcher")
        self.reloaded = asyncio.Event()
        VALID.set(1)

    def on_validity(self, listener: OnValidity) -> None:
        """Call ``listener(valid)`` after each reload attempt (may return an awaitable)."""
        self._listeners.append(listener)

    def check_now(self) -> bool:
        """Reload if the file changed; returns whether a reload was attempted."""
        signature = _signature(self.path)
        if signature == self._signature:
            return False
        self._signature = signature
        try:
            self.policy = load_policy(self.path, known_methods=self.known_methods)
        except PolicyError as error:
            self.valid, self.last_error = False, str(error)
            RELOADS.labels("error").inc()
            VALID.set(0)
            log.warning(
                "authorization policy file is invalid; keeping the last good policy",
                extra={"path": str(self.path), "error": str(error)},
            )
        else:
            self.valid, self.last_error = True, None
            RELOADS.labels("ok").inc()
            VALID.set(1)
            log.info("authorization policy reloaded", extra={"path": str(self.path)})
        return True

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.poll_interval_s)
            try:
                changed = self.check_now()
            except Exception:  # never let the watcher die: the policy stays enforced
                log.exception("policy watcher failed")
                continue
            if changed:
                for listener in self._listeners:
                    result = listener(self.valid)
                    if asyncio.iscoroutine(result):
                        await result
                self.reloaded.set()

    def start(self) -> None:
        if not self._watching:
            self._watching.spawn(self._loop(), name="authz-policy-watcher")

    async def stop(self) -> None:
        await self._watching.close()
