"""The REST endpoints of the emulator's generic kinds (Leases, Secrets), once for all of them.

Each kind stored in an :class:`~turnstile_testing.kube_emulator.objects.ObjectStore` is served
the way the API server serves any resource: list (in a namespace or across all), get, create,
replace, patch (JSON, merge and strategic merge, as for pods) and delete with preconditions.
Watching these kinds is not emulated: a watch is refused with 405.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web

from turnstile_testing.kube_emulator.errors import ApiError
from turnstile_testing.kube_emulator.objects import ObjectStore
from turnstile_testing.kube_emulator.patches import apply_patch
from turnstile_testing.kube_emulator.requests import (
    delete_options,
    json_body,
    json_response,
    parse_bool,
)
from turnstile_testing.kube_emulator.store import encode

_SUCCESS = {"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success"}


class ObjectRoutes:
    """The handlers of one kind's store; ``resource_version`` is the server's current one."""

    def __init__(self, store: ObjectStore, resource_version: Callable[[], int]) -> None:
        self._store = store
        self._resource_version = resource_version

    def add_to(self, router: web.UrlDispatcher, *, every_namespace: str, collection: str) -> None:
        """Route ``every_namespace`` (list across namespaces) and ``collection`` (a
        namespace's, with ``{namespace}``) and its ``/{name}`` items."""
        router.add_get(every_namespace, self._list)
        router.add_get(collection, self._list)
        router.add_post(collection, self._create)
        item = collection + "/{name}"
        router.add_get(item, self._get)
        router.add_put(item, self._replace)
        router.add_patch(item, self._patch)
        router.add_delete(item, self._delete)

    async def _list(self, request: web.Request) -> web.Response:
        kind = self._store.kind
        if parse_bool("watch", request.query.get("watch")):
            raise ApiError(405, f"the emulator does not watch {kind.resource}", "MethodNotAllowed")
        items = self._store.list(
            request.match_info.get("namespace"), request.query.get("labelSelector")
        )
        body = {
            "kind": f"{kind.kind}List",
            "apiVersion": kind.api_version,
            "metadata": {"resourceVersion": str(self._resource_version())},
            "items": items,
        }
        return json_response(encode(body))

    async def _get(self, request: web.Request) -> web.Response:
        m = request.match_info
        return json_response(encode(self._store.get(m["namespace"], m["name"])))

    async def _create(self, request: web.Request) -> web.Response:
        body = await json_body(request)
        return json_response(encode(self._store.create(request.match_info["namespace"], body)), 201)

    async def _replace(self, request: web.Request) -> web.Response:
        m = request.match_info
        body = await json_body(request)
        return json_response(encode(self._store.replace(m["namespace"], m["name"], body)))

    async def _patch(self, request: web.Request) -> web.Response:
        m = request.match_info
        raw = await request.read()
        current = self._store.get(m["namespace"], m["name"])
        patched = apply_patch(request.headers.get("Content-Type", ""), current, raw)
        return json_response(encode(self._store.replace(m["namespace"], m["name"], patched)))

    async def _delete(self, request: web.Request) -> web.Response:
        m = request.match_info
        preconditions = (await delete_options(request)).get("preconditions")
        self._store.delete(
            m["namespace"], m["name"], preconditions if isinstance(preconditions, dict) else None
        )
        return json_response(encode(_SUCCESS))
