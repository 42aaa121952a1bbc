"""The pod calls the substrate makes, over kubernetes-asyncio, on raw JSON.

Every call passes ``_preload_content=False``, so the client hands back the HTTP
response instead of building ``V1Pod`` models; bodies are decoded with
:func:`json.loads` and reduced to :class:`PodInfo`. The client still does what it
is good at — configuration, authentication, URL and query building — and this
module adds what ``_preload_content=False`` skips: turning a non-2xx status into
:class:`KubeApiError` (the client raises only when it preloads).
"""

from __future__ import annotations

import gc
import json
import os
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any

import aiohttp
from kubernetes_asyncio import client as k8s
from kubernetes_asyncio import config as k8s_config

from turnstile_substrate.kubernetes.podinfo import PodInfo, parse_pod
from turnstile_substrate.kubernetes.settings import KubernetesSettings


class KubeApiError(Exception):
    """The API server answered with an error status (or a watch ERROR event)."""

    def __init__(self, status: int, reason: str = "", message: str = "") -> None:
        super().__init__(f"{status} {reason}: {message}".strip())
        self.status = status
        self.reason = reason
        self.message = message

    @property
    def conflict(self) -> bool:
        """409: an optimistic-concurrency loss, a failed precondition or a name taken."""
        return self.status == 409

    @property
    def not_found(self) -> bool:
        return self.status == 404

    @property
    def gone(self) -> bool:
        """410: the resourceVersion or continue token is too old; re-list."""
        return self.status == 410

    @classmethod
    def from_status(cls, status: int, body: bytes) -> KubeApiError:
        """Build from a ``metav1.Status`` body when there is one."""
        reason, message = "", body[:200].decode(errors="replace")
        try:
            doc = json.loads(body)
            if isinstance(doc, dict):
                reason = str(doc.get("reason", ""))
                message = str(doc.get("message", message))
        except ValueError:
            pass
        return cls(status, reason, message)


@dataclass(frozen=True, slots=True)
class PodPage:
    """One page of a pod list."""

    pods: list[PodInfo]
    resource_version: str
    continue_token: str


@dataclass(frozen=True, slots=True)
class WatchEvent:
    """One watch event: ADDED/MODIFIED/DELETED carry a pod, BOOKMARK only a version."""

    type: str
    resource_version: str
    pod: PodInfo | None


async def connect(settings: KubernetesSettings) -> k8s.ApiClient:
    """An ``ApiClient`` per settings: explicit host, in-cluster, or kubeconfig."""
    configuration = k8s.Configuration()
    if settings.api_host:
        configuration.host = settings.api_host
    elif settings.in_cluster if settings.in_cluster is not None else _running_in_cluster():
        k8s_config.load_incluster_config(client_configuration=configuration)  # type: ignore[no-untyped-call]
    else:
        await k8s_config.load_kube_config(
            config_file=settings.kubeconfig,
            context=settings.context,
            client_configuration=configuration,
            persist_config=False,
        )
    return k8s.ApiClient(configuration=configuration)


def _running_in_cluster() -> bool:
    return "KUBERNETES_SERVICE_HOST" in os.environ


class PodsApi:
    """Pods of one namespace: list, watch, get, create, patch labels, delete."""

    def __init__(self, api_client: k8s.ApiClient, settings: KubernetesSettings) -> None:
        self._core = k8s.CoreV1Api(api_client)
        self.namespace = settings.namespace
        self._timeout = aiohttp.ClientTimeout(total=settings.request_timeout_s)
        self._watch_timeout_s = settings.watch_timeout_s
        self._watch_read_timeout = aiohttp.ClientTimeout(
            connect=settings.request_timeout_s,
            sock_connect=settings.request_timeout_s,
            sock_read=settings.watch_timeout_s + settings.watch_read_grace_s,
        )

    async def list_page(self, label_selector: str, limit: int, continue_token: str = "") -> PodPage:
        """One page of the pods matching ``label_selector``."""
        kwargs: dict[str, Any] = {"label_selector": label_selector, "limit": limit}
        if continue_token:
            kwargs["_continue"] = continue_token
        doc = await self._call(self._core.list_namespaced_pod, self.namespace, **kwargs)
        meta = doc.get("metadata") or {}
        return PodPage(
            pods=[parse_pod(item) for item in doc.get("items") or ()],
            resource_version=meta.get("resourceVersion", ""),
            continue_token=meta.get("continue") or "",
        )

    async def list_selected(self, label_selector: str) -> list[PodInfo]:
        """Every pod matching ``label_selector``, straight from the API server (no cache)."""
        pods: list[PodInfo] = []
        token = ""
        while True:
            page = await self.list_page(label_selector, 500, token)
            pods.extend(page.pods)
            token = page.continue_token
            if not token:
                return pods

    async def watch(
        self, label_selector: str, resource_version: str
    ) -> AsyncGenerator[WatchEvent, None]:
        """Events after ``resource_version`` until the server ends the watch.

        Raises :class:`KubeApiError` (410 when the version is too old, as an HTTP
        status or an ERROR event) and transport errors when the connection breaks;
        returns when the stream ends cleanly (``timeoutSeconds`` elapsed).
        """
        # With _preload_content=False the client returns the HTTP response, not a V1PodList.
        response: aiohttp.ClientResponse = await self._core.list_namespaced_pod(  # type: ignore[assignment]
            self.namespace,
            label_selector=label_selector,
            watch=True,
            resource_version=resource_version,
            allow_watch_bookmarks=True,
            timeout_seconds=self._watch_timeout_s,
            _preload_content=False,
            _request_timeout=self._watch_read_timeout,
        )
        try:
            if response.status != 200:
                raise KubeApiError.from_status(response.status, await response.read())
            content = response.content
            while True:
                line = await content.readline()
                if not line:
                    return
                if line.isspace():
                    continue
                yield parse_event(line)
        finally:
            response.release()

    async def read(self, name: str) -> dict[str, Any] | None:
        """The whole pod object, or None when it does not exist."""
        try:
            return await self._call(self._core.read_namespaced_pod, name, self.namespace)
        except KubeApiError as error:
            if error.not_found:
                return None
            raise

    async def get(self, name: str) -> PodInfo | None:
        """The pod's :class:`PodInfo`, or None when it does not exist."""
        obj = await self.read(name)
        return None if obj is None else parse_pod(obj)

    async def create(self, body: dict[str, Any]) -> PodInfo:
        return parse_pod(await self._call(self._core.create_namespaced_pod, self.namespace, body))

    async def patch(self, name: str, body: dict[str, Any]) -> PodInfo:
        """A strategic-merge patch; one carrying ``metadata.resourceVersion`` is applied
        only if the pod is still at that version (409 otherwise)."""
        return parse_pod(
            await self._call(self._core.patch_namespaced_pod, name, self.namespace, body)
        )

    async def delete(
        self, name: str, *, uid: str | None = None, resource_version: str | None = None
    ) -> bool:
        """Delete the pod; False when it was already gone. ``uid``/``resource_version``
        are preconditions: a pod replaced or changed since is left alone (409)."""
        preconditions = {
            key: value
            for key, value in (("uid", uid), ("resourceVersion", resource_version))
            if value
        }
        body = {"preconditions": preconditions} if preconditions else None
        try:
            await self._call(self._core.delete_namespaced_pod, name, self.namespace, body=body)
        except KubeApiError as error:
            if error.not_found:
                return False
            raise
        return True

    async def _call(self, method: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        return await call_raw(method, *args, timeout=self._timeout, **kwargs)


async def call_raw(
    method: Any, *args: Any, timeout: aiohttp.ClientTimeout, **kwargs: Any
) -> dict[str, Any]:
    """Call a kubernetes-asyncio API method without its model layer: the raw JSON
    body decoded, a non-2xx answer raised as :class:`KubeApiError` (the pod and
    Secret stores share this)."""
    response: aiohttp.ClientResponse = await method(
        *args, _preload_content=False, _request_timeout=timeout, **kwargs
    )
    try:
        body = await response.read()
        if not 200 <= response.status <= 299:
            raise KubeApiError.from_status(response.status, body)
    finally:
        response.release()
    return decode(body)


#: Bodies larger than this are decoded with the cyclic garbage collector paused.
_PAUSE_GC_ABOVE = 256 * 1024


def decode(body: bytes) -> dict[str, Any]:
    """Decode a JSON body; a large one (a list page) with the cyclic GC paused.

    ``json.loads`` of a 500-pod page allocates hundreds of thousands of dicts and
    lists, and each allocation burst triggers collections that scan every object
    the process holds — the 50,000-pod cache included — for cycles that JSON
    cannot contain. Pausing the collector for the (synchronous, await-free) decode
    halves the reflector's list time; reference counting still frees everything.
    """
    if len(body) < _PAUSE_GC_ABOVE or not gc.isenabled():
        doc: dict[str, Any] = json.loads(body)
        return doc
    gc.disable()
    try:
        doc = json.loads(body)
    finally:
        gc.enable()
    return doc


def parse_event(line: bytes) -> WatchEvent:
    """One watch-stream line → :class:`WatchEvent`; an ERROR event raises."""
    doc = json.loads(line)
    kind = doc.get("type", "")
    obj = doc.get("object") or {}
    if kind == "ERROR":
        raise KubeApiError(
            int(obj.get("code") or 500), str(obj.get("reason", "")), str(obj.get("message", ""))
        )
    if kind == "BOOKMARK":
        return WatchEvent(kind, obj["metadata"]["resourceVersion"], None)
    pod = parse_pod(obj)
    return WatchEvent(kind, pod.resource_version, pod)
