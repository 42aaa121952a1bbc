"""The HTTP face of the emulator and its test-facing Python API (:class:`KubeEmulator`).

Routes are the core/v1 pod endpoints kubernetes-asyncio and kubectl use, plus the discovery
documents kubectl reads first. Every error leaves as a ``Status`` object. Test hooks act on the
same store the HTTP handlers use, synchronously, so a test can change the world between two
client calls without racing the server.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Any, Self

from aiohttp import web

from turnstile_testing.kube_emulator import discovery
from turnstile_testing.kube_emulator.errors import ApiError, bad_request, status_object
from turnstile_testing.kube_emulator.faults import Fault, FaultInjector, PathMatcher
from turnstile_testing.kube_emulator.kubelet import Kubelet, KubeletConfig, mark_failed
from turnstile_testing.kube_emulator.leases import LeaseStore
from turnstile_testing.kube_emulator.object_routes import ObjectRoutes
from turnstile_testing.kube_emulator.patches import apply_patch
from turnstile_testing.kube_emulator.podsecurity import check_pod_security
from turnstile_testing.kube_emulator.requests import (
    JSON,
    TRUE,
    delete_options,
    json_body,
    json_response,
    parse_bool,
)
from turnstile_testing.kube_emulator.secrets import SecretStore
from turnstile_testing.kube_emulator.selectors import FieldSelector, LabelSelector, PodFilter
from turnstile_testing.kube_emulator.store import Control, PodStore, StoredPod, Subscription, encode
from turnstile_testing.kube_emulator.watch import WatchOptions, WatchStream, error_line

if TYPE_CHECKING:
    from kubernetes_asyncio.client import ApiClient

_log = logging.getLogger(__name__)


def _parse_int(name: str, value: str | None) -> int | None:
    if value is None or value == "":
        return None
    try:
        return int(value)
    except ValueError:
        raise bad_request(f'invalid integer value for "{name}": {value}') from None


def _error_response(error: ApiError) -> web.Response:
    return json_response(encode(error.status()), error.code)


def _pod_list_body(
    resource_version: int, items: list[bytes], token: str | None, remaining: int | None
) -> bytes:
    meta: dict[str, Any] = {"resourceVersion": str(resource_version)}
    if token:
        meta["continue"] = token
    if remaining is not None:
        meta["remainingItemCount"] = remaining
    return (
        b'{"kind":"PodList","apiVersion":"v1","metadata":'
        + encode(meta)
        + b',"items":['
        + b",".join(items)
        + b"]}"
    )


@dataclass(frozen=True, slots=True)
class RecordedRequest:
    """One request as the emulator saw it (for assertions such as "it re-listed after 410")."""

    method: str
    path: str
    query: dict[str, str]
    content_type: str

    @property
    def is_watch(self) -> bool:
        """Whether this was a watch request."""
        return self.query.get("watch", "").lower() in TRUE


class KubeEmulator:
    """A Kubernetes API server (pods, leases and secrets) on ``127.0.0.1:<free port>`` for tests.

    Use as ``async with KubeEmulator() as kube:``; point clients at :attr:`url` or use
    :meth:`api_client`. ``bookmark_interval`` is how often watches with
    ``allowWatchBookmarks=true`` get a BOOKMARK (the real server: about a minute);
    ``history_limit`` bounds the event history (older versions then get 410 Expired);
    ``record_requests=False`` stops filling :attr:`requests` (for long benchmarks).

    Closer to a real cluster, each opt-in so existing tests keep their instant world:
    ``graceful_deletion`` (a DELETE marks a scheduled pod Terminating for its grace period;
    :meth:`finish_termination` or the kubelet removes it), ``kubelet`` (a scheduler and
    kubelet loop: node assignment, Pending → Running after a delay, Terminating → gone,
    :meth:`fail_pod`), ``pod_security`` (the Pod Security admission level enforced on pods
    created over HTTP: ``restricted`` as the manifests label the sandbox namespace).
    ``future_version_wait`` is how long a list at a future resourceVersion waits.
    """

    def __init__(
        self,
        *,
        bookmark_interval: float = 60.0,
        history_limit: int | None = 100_000,
        host: str = "127.0.0.1",
        record_requests: bool = True,
        graceful_deletion: bool = False,
        kubelet: KubeletConfig | None = None,
        pod_security: str | None = None,
        future_version_wait: float = 3.0,
    ) -> None:
        self.store = PodStore(history_limit=history_limit, graceful_deletion=graceful_deletion)
        self.kubelet_config = kubelet
        self._kubelet: Kubelet | None = None
        if pod_security not in (None, "privileged", "baseline", "restricted"):
            raise ValueError(f"unknown Pod Security level {pod_security!r}")
        self.pod_security = pod_security
        self.future_version_wait = future_version_wait
        #: (method, path pattern, seconds, after the write)
        self._delays: list[tuple[str | None, re.Pattern[str] | None, float, bool]] = []
        self.leases = LeaseStore(self.store.next_version)
        self.secrets = SecretStore(self.store.next_version)
        self.faults = FaultInjector()
        self.requests: list[RecordedRequest] = []
        self.record_requests = record_requests
        self.bookmark_interval = bookmark_interval
        self._host = host
        self._port: int | None = None
        self._runner: web.AppRunner | None = None
        self._streams: dict[Subscription, web.Request] = {}

    # ----------------------------------------------------------------- lifecycle

    async def __aenter__(self) -> Self:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def start(self) -> None:
        """Bind a free port and start serving."""
        app = web.Application(middlewares=[self._middleware], client_max_size=64 * 1024**2)
        self._add_routes(app)
        # handler_cancellation: a watch handler is cancelled when its client goes away, so the
        # subscription is released instead of waiting forever on an idle queue.
        runner = web.AppRunner(
            app,
            handle_signals=False,
            access_log=None,
            handler_cancellation=True,
            shutdown_timeout=1.0,
        )
        await runner.setup()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self._host, 0))
        self._port = sock.getsockname()[1]
        site = web.SockSite(runner, sock)
        await site.start()
        self._runner = runner
        if self.kubelet_config is not None:
            self._kubelet = Kubelet(self.store, self.kubelet_config)
            self._kubelet.start()

    async def stop(self) -> None:
        """End every watch gracefully, then stop serving."""
        if self._kubelet is not None:
            await self._kubelet.stop()
            self._kubelet = None
        self.end_watches()
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @property
    def port(self) -> int:
        """The bound port (after :meth:`start`)."""
        if self._port is None:
            raise RuntimeError("the emulator is not started")
        return self._port

    @property
    def url(self) -> str:
        """``http://127.0.0.1:<port>``, the value for ``Configuration.host`` or ``--server``."""
        return f"http://{self._host}:{self.port}"

    def api_client(self) -> ApiClient:
        """A kubernetes-asyncio ``ApiClient`` for this server (the caller closes it)."""
        from kubernetes_asyncio.client import ApiClient, Configuration

        configuration = Configuration(host=self.url)
        return ApiClient(configuration=configuration)

    # ----------------------------------------------------------------- test hooks

    @property
    def resource_version(self) -> int:
        """The latest resourceVersion."""
        return self.store.resource_version

    @property
    def watch_count(self) -> int:
        """Number of open watch streams."""
        return len(self.store.subscribers)

    async def wait_for_watches(self, count: int, timeout: float = 5.0) -> None:
        """Wait until exactly ``count`` watches are open (e.g. "the client is now watching")."""
        async with asyncio.timeout(timeout):
            await self.store.wait_subscribers(lambda n: n == count)

    def cut_watches(self) -> int:
        """Drop every watch connection abruptly (no end of stream); return how many.

        Clients see a broken connection mid-stream, like an API server restart or a network cut.
        """
        subs = list(self.store.subscribers)
        for sub in subs:
            request = self._streams.get(sub)
            if request is not None and request.transport is not None:
                request.transport.abort()
            sub.queue.put_nowait(Control.CUT)
            self.store.unsubscribe(sub)
        return len(subs)

    def end_watches(self) -> int:
        """End every watch stream cleanly (as a server-side timeout does); return how many."""
        subs = list(self.store.subscribers)
        for sub in subs:
            sub.queue.put_nowait(Control.END)
            self.store.unsubscribe(sub)
        return len(subs)

    def compact(self, keep: int = 0) -> int:
        """Forget history but the last ``keep`` events; older versions then get 410 Expired."""
        return self.store.compact(keep)

    def inject_failure(
        self,
        status: int,
        *,
        method: str | None = None,
        path: PathMatcher = None,
        times: int = 1,
        reason: str | None = None,
        message: str | None = None,
        watch: bool | None = None,
    ) -> Fault:
        """Fail the next ``times`` requests matching ``method``/``path``/``watch`` with ``status``.

        Example: ``kube.inject_failure(409, method="PATCH", path=r".*/pods/p1")``.
        """
        return self.faults.add(Fault(status, method, path, times, reason, message, watch))

    def delay_requests(
        self,
        seconds: float,
        *,
        method: str | None = None,
        path: str | None = None,
        after_write: bool = False,
    ) -> None:
        """Answer matching non-watch requests ``seconds`` late (a slow API server). By default
        the write happens after the delay, so a client that goes away meanwhile leaves nothing
        behind; with ``after_write`` it happens at once and only the answer is late, so a client
        that goes away (or dies) meanwhile leaves its object behind, as with a real server.
        ``path`` is a regular expression over the whole path. ``seconds=0`` removes the rule."""
        self._delays = [d for d in self._delays if (d[0], d[1] and d[1].pattern) != (method, path)]
        if seconds > 0:
            self._delays.append((method, re.compile(path) if path else None, seconds, after_write))

    def clear_failures(self) -> None:
        """Remove every injected failure."""
        self.faults.clear()

    def pods(self, namespace: str | None = None) -> list[dict[str, Any]]:
        """The truth: every current pod (copies), sorted by namespace and name."""
        return [p.thaw() for p in self.store.all(namespace)]

    def lease(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One Lease (a copy), or None."""
        try:
            return self.leases.get(namespace, name)
        except ApiError:
            return None

    def secret(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One Secret (a copy), or None."""
        try:
            return self.secrets.get(namespace, name)
        except ApiError:
            return None

    def pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        """One pod (a copy), or None."""
        try:
            return self.store.get(namespace, name).thaw()
        except ApiError:
            return None

    def create_pod(
        self, namespace: str, body: dict[str, Any], *, validate: bool = True
    ) -> dict[str, Any]:
        """Create a pod without HTTP (fast seeding); same rules and events as a POST."""
        return self.store.create(namespace, body, validate=validate).thaw()

    def delete_pod(
        self, namespace: str, name: str, *, grace_period_seconds: int | None = None
    ) -> dict[str, Any]:
        """Delete a pod without HTTP; same rules and events as a DELETE."""
        return self.store.delete(namespace, name, None, grace_period_seconds).thaw()

    def finish_termination(self, namespace: str, name: str) -> dict[str, Any] | None:
        """End a Terminating pod's grace (its containers stopped): it is removed unless
        finalizers hold it. None when it was not terminating."""
        stored = self.store.finish_termination(namespace, name)
        return None if stored is None else stored.thaw()

    def fail_pod(
        self, namespace: str, name: str, reason: str = "Error", message: str = ""
    ) -> dict[str, Any]:
        """The pod's containers exited with an error (or it was evicted): phase Failed."""
        return self.mutate_pod(namespace, name, lambda pod: mark_failed(pod, reason, message))

    def mutate_pod(
        self, namespace: str, name: str, change: Callable[[dict[str, Any]], None]
    ) -> dict[str, Any]:
        """Edit a pod in place of a kubelet/scheduler (no validation); emits MODIFIED."""
        return self.store.mutate(namespace, name, change).thaw()

    def set_pod_phase(
        self, namespace: str, name: str, phase: str, *, ready: bool | None = None
    ) -> dict[str, Any]:
        """Set ``status.phase`` (and, if ``ready`` is given, the Ready condition)."""

        def change(pod: dict[str, Any]) -> None:
            status = pod.setdefault("status", {})
            status["phase"] = phase
            if ready is not None:
                conditions = [c for c in status.get("conditions", []) if c.get("type") != "Ready"]
                conditions.append({"type": "Ready", "status": "True" if ready else "False"})
                status["conditions"] = conditions

        return self.mutate_pod(namespace, name, change)

    def set_node_name(self, namespace: str, name: str, node: str | None) -> dict[str, Any]:
        """Bind (or unbind, with None) a pod to a node, as the scheduler's binding does."""

        def change(pod: dict[str, Any]) -> None:
            spec = pod.setdefault("spec", {})
            if node is None:
                spec.pop("nodeName", None)
            else:
                spec["nodeName"] = node

        return self.mutate_pod(namespace, name, change)

    # ----------------------------------------------------------------- HTTP

    def _add_routes(self, app: web.Application) -> None:
        pods = "/api/v1/namespaces/{namespace}/pods"
        app.router.add_get("/version", self._version)
        app.router.add_get("/api", self._api)
        app.router.add_get("/apis", self._apis)
        app.router.add_get("/api/v1", self._core_v1)
        app.router.add_get("/api/v1/namespaces/{namespace}", self._namespace)
        app.router.add_get("/api/v1/pods", self._list_or_watch)
        app.router.add_get(pods, self._list_or_watch)
        app.router.add_post(pods, self._create)
        for suffix, sub in (("/{name}", None), ("/{name}/status", "status")):
            app.router.add_get(pods + suffix, self._get)
            app.router.add_put(pods + suffix, self._make_update(sub))
            app.router.add_patch(pods + suffix, self._make_patch(sub))
        app.router.add_delete(pods + "/{name}", self._delete)
        coordination = "/apis/coordination.k8s.io"
        ObjectRoutes(self.secrets, lambda: self.store.resource_version).add_to(
            app.router,
            every_namespace="/api/v1/secrets",
            collection="/api/v1/namespaces/{namespace}/secrets",
        )
        app.router.add_get(coordination, self._coordination_group)
        app.router.add_get(coordination + "/v1", self._coordination_v1)
        ObjectRoutes(self.leases, lambda: self.store.resource_version).add_to(
            app.router,
            every_namespace=coordination + "/v1/leases",
            collection=coordination + "/v1/namespaces/{namespace}/leases",
        )

    @web.middleware
    async def _middleware(
        self, request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
    ) -> web.StreamResponse:
        query = dict(request.query)
        if self.record_requests:
            self.requests.append(
                RecordedRequest(
                    request.method, request.path, query, request.headers.get("Content-Type", "")
                )
            )
        try:
            injected = self.faults.take(
                request.method, request.path, query.get("watch", "").lower() in TRUE
            )
            if injected is not None:
                return _error_response(injected)
            if "dryRun" in query:
                raise bad_request("the emulator does not implement dryRun")
            delay = None
            if self._delays and query.get("watch", "").lower() not in TRUE:
                delay = self._delay_of(request.method, request.path)
            if delay is not None and not delay[1]:
                await asyncio.sleep(delay[0])
            response = await handler(request)
            if delay is not None and delay[1]:
                await asyncio.sleep(delay[0])
            return response
        except ApiError as exc:
            return _error_response(exc)
        except web.HTTPNotFound:
            return json_response(
                encode(
                    status_object(
                        404, "the server could not find the requested resource", "NotFound", {}
                    )
                ),
                404,
            )
        except web.HTTPMethodNotAllowed:
            return json_response(
                encode(
                    status_object(
                        405,
                        "the server does not allow this method on the requested resource",
                        "MethodNotAllowed",
                        {},
                    )
                ),
                405,
            )

    def _delay_of(self, method: str, path: str) -> tuple[float, bool] | None:
        """The first matching delay rule's seconds and whether it comes after the write."""
        for wanted, pattern, seconds, after_write in self._delays:
            if wanted is not None and wanted.upper() != method.upper():
                continue
            if pattern is not None and pattern.fullmatch(path) is None:
                continue
            return seconds, after_write
        return None

    async def _version(self, _: web.Request) -> web.Response:
        return json_response(encode(discovery.SERVER_VERSION))

    async def _api(self, _: web.Request) -> web.Response:
        return json_response(encode(discovery.api_versions(f"{self._host}:{self.port}")))

    async def _apis(self, _: web.Request) -> web.Response:
        return json_response(encode(discovery.API_GROUP_LIST))

    async def _core_v1(self, _: web.Request) -> web.Response:
        return json_response(encode(discovery.CORE_V1_RESOURCES))

    async def _namespace(self, request: web.Request) -> web.Response:
        return json_response(encode(discovery.namespace(request.match_info["namespace"])))

    async def _coordination_group(self, _: web.Request) -> web.Response:
        return json_response(encode(discovery.COORDINATION_GROUP))

    async def _coordination_v1(self, _: web.Request) -> web.Response:
        return json_response(encode(discovery.COORDINATION_V1_RESOURCES))

    # ----------------------------------------------------------------- pods

    @staticmethod
    def _filter(request: web.Request) -> PodFilter:
        q = request.query
        return PodFilter(
            request.match_info.get("namespace"),
            LabelSelector.parse(q.get("labelSelector")),
            FieldSelector.parse(q.get("fieldSelector")),
        )

    async def _list_or_watch(self, request: web.Request) -> web.StreamResponse:
        flt = self._filter(request)
        q = request.query
        if parse_bool("watch", q.get("watch")):
            return await self._watch(request, flt)
        wanted = _parse_int("resourceVersion", q.get("resourceVersion"))
        if (
            wanted is not None
            and wanted > self.store.resource_version
            and q.get("resourceVersionMatch") != "Exact"
            and not q.get("continue")
        ):
            # A list at a version the cache has not reached waits for it (the real server
            # waits up to 3 s, then answers 504 "Too large resource version").
            await self.store.wait_for_version(wanted, self.future_version_wait)
        page = self.store.list(
            flt,
            resource_version=q.get("resourceVersion"),
            resource_version_match=q.get("resourceVersionMatch"),
            limit=_parse_int("limit", q.get("limit")),
            continue_token=q.get("continue"),
        )
        return json_response(
            _pod_list_body(page.resource_version, page.items, page.continue_token, page.remaining)
        )

    async def _watch(self, request: web.Request, flt: PodFilter) -> web.StreamResponse:
        q = request.query
        send_initial = parse_bool("sendInitialEvents", q.get("sendInitialEvents"))
        bookmarks = parse_bool("allowWatchBookmarks", q.get("allowWatchBookmarks"))
        timeout = _parse_int("timeoutSeconds", q.get("timeoutSeconds"))
        response = web.StreamResponse(status=200, headers={"Content-Type": JSON})
        response.enable_chunked_encoding()
        try:
            rv = "0" if send_initial else q.get("resourceVersion")
            sub = self.store.subscribe(flt, rv)
        except ApiError as exc:
            if exc.code != 410:
                raise
            # The API server accepts the watch, then reports the expiry as an ERROR event.
            await response.prepare(request)
            await response.write(error_line(exc))
            await response.write_eof()
            return response
        self._streams[sub] = request
        outcome: str | None = None
        try:
            await response.prepare(request)
            stream = WatchStream(
                self.store,
                sub,
                WatchOptions(
                    bookmarks=bookmarks,
                    bookmark_interval=self.bookmark_interval,
                    timeout=None if timeout is None or timeout <= 0 else float(timeout),
                    initial_events_end_bookmark=send_initial and bookmarks,
                ),
            )
            outcome = await stream.run(response.write)
        finally:
            self.store.unsubscribe(sub)
            self._streams.pop(sub, None)
        if outcome == Control.CUT:
            if request.transport is not None:
                request.transport.abort()
            return response
        with contextlib.suppress(ConnectionResetError):
            await response.write_eof()
        return response

    def _stored(self, request: web.Request) -> StoredPod:
        return self.store.get(request.match_info["namespace"], request.match_info["name"])

    async def _get(self, request: web.Request) -> web.Response:
        return json_response(self._stored(request).raw)

    async def _create(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        if self.pod_security is not None and isinstance(body, dict):
            check_pod_security(self.pod_security, body)
        stored = self.store.create(request.match_info["namespace"], body)
        return json_response(stored.raw, 201)

    def _make_update(
        self, subresource: str | None
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def update(request: web.Request) -> web.Response:
            body = await json_body(request)
            stored = self.store.replace(
                request.match_info["namespace"],
                request.match_info["name"],
                body,
                subresource=subresource,
            )
            return json_response(stored.raw)

        return update

    def _make_patch(
        self, subresource: str | None
    ) -> Callable[[web.Request], Awaitable[web.Response]]:
        async def patch(request: web.Request) -> web.Response:
            raw = await request.read()
            current = self._stored(request)
            patched = apply_patch(request.headers.get("Content-Type", ""), current.thaw(), raw)
            stored = self.store.replace(
                request.match_info["namespace"],
                request.match_info["name"],
                patched,
                subresource=subresource,
            )
            return json_response(stored.raw)

        return patch

    async def _delete(self, request: web.Request) -> web.Response:
        options = await delete_options(request)
        preconditions = options.get("preconditions")
        grace = options.get("gracePeriodSeconds")
        if grace is None:
            grace = _parse_int("gracePeriodSeconds", request.query.get("gracePeriodSeconds"))
        if grace is not None and not isinstance(grace, int):
            raise bad_request("gracePeriodSeconds must be an integer")
        stored = self.store.delete(
            request.match_info["namespace"],
            request.match_info["name"],
            preconditions if isinstance(preconditions, dict) else None,
            grace,
        )
        return json_response(stored.raw)
