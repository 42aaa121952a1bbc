"""Sandbox credentials on Kubernetes (SPEC Z3): one Secret per sandbox pod, renewed by the leader.

The credential lives in the Secret ``<pod name>-credential``, which every pod
mounts as an optional volume (:mod:`.template`), never in the pod spec where
anyone who can list pods would read it. It is written *before* the pod becomes
the sandbox's, so the kubelet sync that follows finds it. A cold pod's uid and IP
exist only after its create, so rather than make every cold start wait for a
second Secret sync, its first credential binds neither and the first renewal
binds both (SPEC O3: Place returns no endpoint until then, never one the worker
chose). The generation is derived from the pod name, sandbox and activation, so
a retried create keeps its Secret.

Renewal is leader-only work (``sandbox-credential-renewal``): one paged list of
the Secrets per pass, re-minting those past half their ttl, revoking and deleting
orphans, paced to ``TURNSTILE_K8S_CREDENTIAL_RENEW_RATE``. Stopping a runtime
revokes the record first, then deletes its Secrets and pods. Details are in
docs/substrate-kubernetes.md ("Sandbox credentials") and docs/security.md.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s

from turnstile_platform.leader import LeaderTerm
from turnstile_platform.sandbox_credentials import (
    CredentialIssuer,
    Issued,
    PresenceClaims,
    now_ms,
)
from turnstile_substrate.kubernetes import metrics, template
from turnstile_substrate.kubernetes.api import KubeApiError, call_raw
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.runtime import LABEL_MANAGED_BY, LABEL_SANDBOX_ID, MANAGED_BY, RuntimeSpec

log = logging.getLogger(__name__)

#: ``app.kubernetes.io/component`` of credential Secrets: what the renewal pass lists.
COMPONENT = "worker-credential"
LABEL_COMPONENT = "app.kubernetes.io/component"
#: The pod the Secret belongs to (a label, so the orphan sweep needs no parsing of names).
LABEL_POD = "turnstile.dev/pod"
ANNOTATION_GENERATION = "turnstile.dev/credential-generation"
ANNOTATION_EXPIRES = "turnstile.dev/credential-expires-ms"
ANNOTATION_ENDPOINT = "turnstile.dev/credential-endpoint"

SELECTOR = f"{LABEL_MANAGED_BY}={MANAGED_BY},{LABEL_COMPONENT}={COMPONENT}"


def activation_generation(pod_name: str, spec: RuntimeSpec) -> str:
    """The credential generation of ``spec``'s runtime in ``pod_name``: the same for every
    attempt at one activation in one pod, different for any other (128 bits, hex)."""
    seed = f"{pod_name}\x00{spec.sandbox_id}\x00{spec.generation}".encode()
    return hashlib.sha256(seed).hexdigest()[:32]


class SecretsApi:
    """Secrets of one namespace over kubernetes-asyncio, raw JSON like :class:`.api.PodsApi`."""

    def __init__(self, api_client: k8s.ApiClient, settings: KubernetesSettings) -> None:
        self._core = k8s.CoreV1Api(api_client)
        self.namespace = settings.namespace
        self._timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s)

    async def create(self, body: dict[str, Any]) -> dict[str, Any]:
        return await self._call(self._core.create_namespaced_secret, self.namespace, body)

    async def read(self, name: str) -> dict[str, Any] | None:
        try:
            return await self._call(self._core.read_namespaced_secret, name, self.namespace)
        except KubeApiError as error:
            if error.not_found:
                return None
            raise

    async def replace(self, name: str, body: dict[str, Any]) -> dict[str, Any]:
        """A PUT; a ``metadata.resourceVersion`` in ``body`` makes it conditional (409)."""
        return await self._call(self._core.replace_namespaced_secret, name, self.namespace, body)

    async def list_selected(self, label_selector: str) -> list[dict[str, Any]]:
        """Every matching Secret, in pages of 500."""
        items: list[dict[str, Any]] = []
        token = ""
        while True:
            kwargs: dict[str, Any] = {"label_selector": label_selector, "limit": 500}
            if token:
                kwargs["_continue"] = token
            doc = await self._call(self._core.list_namespaced_secret, self.namespace, **kwargs)
            items.extend(doc.get("items") or ())
            token = (doc.get("metadata") or {}).get("continue") or ""
            if not token:
                return items

    async def delete(self, name: str, *, uid: str | None = None) -> bool:
        """Delete the Secret; False when it was already gone. ``uid`` is a precondition."""
        body = {"preconditions": {"uid": uid}} if uid else None
        try:
            await self._call(self._core.delete_namespaced_secret, name, self.namespace, body=body)
        except KubeApiError as error:
            if error.not_found:
                return False
            raise
        return True

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await call_raw(method, *args, timeout=self._timeout, **kwargs)


@dataclass(frozen=True)
class RenewalResult:
    """What one renewal pass did."""

    renewed: int = 0
    revoked: int = 0
    swept: int = 0
    failed: int = 0


class CredentialDelivery:
    """Mints, delivers, renews and removes the credential Secrets of sandbox pods."""

    def __init__(
        self,
        api: SecretsApi,
        issuer: CredentialIssuer,
        index: PodIndex,
        settings: KubernetesSettings,
        synced: asyncio.Event,
        *,
        renew_interval_s: float,
        pace: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        """``pace`` waits between writes of a renewal pass (tests pass a no-op)."""
        self.api = api
        self.issuer = issuer
        self._index = index
        self._settings = settings
        self._synced = synced
        self._renew_interval_s = renew_interval_s
        self._pace = pace
        #: renewal passes the loop has finished here (a follower's stays 0), and an event
        #: set after each, for tests and probes
        self.passes = 0
        self.pass_done = asyncio.Event()

    # ------------------------------------------------------------------ delivery

    def presence(self, client_label: str | None, tier: str, pod_ip: str) -> PresenceClaims:
        """What a sandbox pod's credential attests (SPEC O3)."""
        port = self._settings.worker_port
        endpoint = f"{pod_ip}:{port}" if pod_ip and port else ""
        return PresenceClaims(
            owner=client_label or "",
            tier=tier,
            capacity=self._settings.worker_capacity,
            endpoint=endpoint,
        )

    async def deliver(
        self, pod_name: str, spec: RuntimeSpec, *, pod_uid: str = "", pod_ip: str = ""
    ) -> Issued:
        """Record and write the credential of ``spec``'s runtime in ``pod_name``.

        Idempotent per activation: a Secret already there for the same sandbox and
        generation (a retried create) is kept. Raises :class:`KubeApiError` 409 when the
        name is held by another sandbox's Secret (a concurrent warm claim of the pod).
        """
        generation = activation_generation(pod_name, spec)
        presence = self.presence(spec.client_label, spec.tier, pod_ip)
        issued = await self.issuer.issue(
            spec.sandbox_id, pod_uid=pod_uid, generation=generation, presence=presence
        )
        body = self._secret_body(pod_name, spec.sandbox_id, issued, pod_uid, presence.endpoint)
        try:
            await self.api.create(body)
        except KubeApiError as error:
            if not error.conflict:
                raise
            existing = await self.api.read(body["metadata"]["name"])
            meta = (existing or {}).get("metadata") or {}
            same = (meta.get("labels") or {}).get(LABEL_SANDBOX_ID) == spec.sandbox_id and (
                meta.get("annotations") or {}
            ).get(ANNOTATION_GENERATION) == generation
            if not same:
                raise
        metrics.CREDENTIAL_WRITES.labels(kind="issued").inc()
        return issued

    async def remove_for_pod(self, pod_name: str, sandbox_id: str) -> None:
        """Delete ``pod_name``'s Secret if it is ``sandbox_id``'s (a failed warm claim)."""
        name = template.credential_secret_name(pod_name)
        existing = await self.api.read(name)
        if existing is None:
            return
        meta = existing["metadata"]
        if (meta.get("labels") or {}).get(LABEL_SANDBOX_ID) == sandbox_id:
            try:
                await self.api.delete(name, uid=meta.get("uid"))
            except KubeApiError as error:
                if not error.conflict:
                    raise

    async def delete_secrets(self, sandbox_id: str) -> int:
        """Delete every credential Secret of the sandbox (its runtime ended; revoke first)."""
        deleted = 0
        for secret in await self.api.list_selected(f"{SELECTOR},{LABEL_SANDBOX_ID}={sandbox_id}"):
            meta = secret["metadata"]
            if await self.api.delete(meta["name"], uid=meta.get("uid")):
                deleted += 1
        return deleted

    def _secret_body(
        self, pod_name: str, sandbox_id: str, issued: Issued, pod_uid: str, endpoint: str
    ) -> dict[str, Any]:
        metadata: dict[str, Any] = {
            "name": template.credential_secret_name(pod_name),
            "namespace": self._settings.namespace,
            "labels": {
                LABEL_MANAGED_BY: MANAGED_BY,
                LABEL_COMPONENT: COMPONENT,
                LABEL_SANDBOX_ID: sandbox_id,
                LABEL_POD: pod_name,
            },
            "annotations": {
                ANNOTATION_GENERATION: issued.generation,
                ANNOTATION_EXPIRES: str(issued.expires_ms),
                ANNOTATION_ENDPOINT: endpoint,
            },
        }
        if pod_uid:
            # Garbage-collected with its pod, should every sweep miss it.
            metadata["ownerReferences"] = [
                {"apiVersion": "v1", "kind": "Pod", "name": pod_name, "uid": pod_uid}
            ]
        encoded = base64.b64encode(issued.credential.encode()).decode("ascii")
        return {
            "apiVersion": "v1",
            "kind": "Secret",
            "type": "Opaque",
            "metadata": metadata,
            "data": {template.CREDENTIAL_KEY: encoded},
        }

    # ------------------------------------------------------------------ renewal (leader)

    async def run(self, term: LeaderTerm) -> None:
        """The renewal loop, while this replica leads (cancelled when it stops leading)."""
        del term
        await self._synced.wait()
        while True:
            # An interval first: a new leader's credentials are at most an interval older
            # than the last pass made them, far inside the half-ttl margin.
            await asyncio.sleep(self._renew_interval_s)
            try:
                result = await self.renew_pass()
                if result.renewed or result.swept or result.failed:
                    log.info(
                        "renewed sandbox credentials",
                        extra={
                            "renewed": result.renewed,
                            "swept": result.swept,
                            "failed": result.failed,
                        },
                    )
            except Exception:
                log.warning("sandbox credential renewal failed; retrying later", exc_info=True)
            self.passes += 1
            self.pass_done.set()

    async def renew_pass(self, *, at_ms: int | None = None) -> RenewalResult:
        """One pass over every credential Secret: renew those past half their ttl whose
        pod lives, delete orphans past the grace. Writes are paced."""
        now = now_ms() if at_ms is None else at_ms
        due_before = now + self.issuer.ttl_ms // 2
        gap_s = 1.0 / self._settings.credential_renew_rate
        renewed = revoked = swept = failed = 0
        for secret in await self.api.list_selected(SELECTOR):
            meta = secret["metadata"]
            labels = meta.get("labels") or {}
            annotations = meta.get("annotations") or {}
            pod_name = labels.get(LABEL_POD, "")
            sandbox_id = labels.get(LABEL_SANDBOX_ID, "")
            pod = self._index.pods.get(pod_name)
            try:
                if pod is None or pod.sandbox_id != sandbox_id or not pod.live:
                    if _age_s(meta, now) >= self._settings.credential_orphan_grace_s:
                        # Its runtime is gone (a pod deleted outside Deactivate, a claim
                        # that failed half-way): revoke it unless a newer runtime of the
                        # sandbox has replaced its generation, then delete the Secret.
                        generation = annotations.get(ANNOTATION_GENERATION, "")
                        if sandbox_id and generation:
                            await self.issuer.revoke_generation(sandbox_id, generation)
                        await self.api.delete(meta["name"], uid=meta.get("uid"))
                        metrics.CREDENTIAL_WRITES.labels(kind="swept").inc()
                        swept += 1
                        await self._pace(gap_s)
                    continue
                expires = int(annotations.get(ANNOTATION_EXPIRES) or 0)
                presence = self.presence(pod.client_label, pod.tier, pod.ip)
                if (
                    expires > due_before
                    and (pod.uid == "" or _bound_uid(meta) == pod.uid)
                    and annotations.get(ANNOTATION_ENDPOINT, "") == presence.endpoint
                ):
                    continue
                generation = annotations.get(ANNOTATION_GENERATION, "")
                issued = await self.issuer.renew(
                    sandbox_id, generation, pod_uid=pod.uid, presence=presence
                )
                if issued is None:
                    revoked += 1  # the runtime is ending; its Secret goes with it
                    continue
                body = self._secret_body(pod_name, sandbox_id, issued, pod.uid, presence.endpoint)
                body["metadata"]["resourceVersion"] = meta.get("resourceVersion")
                await self.api.replace(meta["name"], body)
                metrics.CREDENTIAL_WRITES.labels(kind="renewed").inc()
                renewed += 1
                await self._pace(gap_s)
            except Exception as error:
                failed += 1
                metrics.CREDENTIAL_WRITES.labels(kind="failed").inc()
                log.warning("credential Secret %s: %s", meta.get("name"), error)
        return RenewalResult(renewed, revoked, swept, failed)


def _bound_uid(meta: dict[str, Any]) -> str:
    for ref in meta.get("ownerReferences") or ():
        if ref.get("kind") == "Pod":
            return str(ref.get("uid", ""))
    return ""


def _age_s(meta: dict[str, Any], now: int) -> float:
    created = meta.get("creationTimestamp") or ""
    try:
        stamp = datetime.fromisoformat(str(created).replace("Z", "+00:00"))
    except ValueError:
        return float("inf")
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return now / 1000 - stamp.timestamp()


__all__ = ["CredentialDelivery", "RenewalResult", "SecretsApi", "activation_generation"]
