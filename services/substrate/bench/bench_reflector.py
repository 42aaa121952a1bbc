"""Benchmark of the Kubernetes substrate's reflector: raw-JSON path against client models.

    uv run python services/substrate/bench/bench_reflector.py [--pods 50000] [--events 20000]

The API-server emulator runs in a subprocess (the other core), seeded with realistic
sandbox pods, so the figures are the client's cost. Measured in one run:

* **initial list** of all pods, paged by 500 as the reflector does: the raw path
  (``_preload_content=False`` + ``json.loads`` + :func:`parse_pod` + index) against the
  client-model path (``V1PodList`` models, then the same fields read off the models),
  each as a ratio to a *ceiling*: fetching the same pages as bytes without decoding;
* **watch-event ingest rate**: a watch replaying N MODIFIED events from history, raw
  path (the reflector's own ``PodsApi.watch`` + index) against kubernetes-asyncio's
  ``Watch`` (a ``V1Pod`` per event), with the ceiling of reading the lines only;
* **memory per cached pod** (tracemalloc): a ``PodInfo`` in the index against a ``V1Pod``;
* **count_live latency** at 10 and at 50,000 pods, and the key-set-change recount
  (O(distinct client ids)) against a full rebuild (O(pods)).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import statistics
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

from kubernetes_asyncio import client as k8s
from kubernetes_asyncio.watch import Watch

from turnstile_clientkeys import KeySet, Resolver
from turnstile_substrate.kubernetes import KubernetesSettings, template
from turnstile_substrate.kubernetes.api import PodsApi
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.podinfo import PodInfo, parse_pod
from turnstile_substrate.kubernetes.reflector import Reflector
from turnstile_substrate.runtime import (
    LABEL_CLIENT_ID,
    LABEL_POOL,
    LABEL_SANDBOX_ID,
    LABEL_TIER,
    RuntimeSpec,
)

NS = "sandboxes"
CLIENTS = 1000
ALLOWLISTED = 100
PAGE = 500


# ---------------------------------------------------------------------------- emulator side


def realistic_pod(settings: KubernetesSettings, i: int) -> dict[str, Any]:
    """A sandbox pod as a kubelet-updated API server returns it (without managedFields)."""
    spec = RuntimeSpec(
        sandbox_id=f"sbx-{i:06d}", tier="default", client_label=f"client-{i % CLIENTS}"
    )
    pod = template.sandbox_pod(settings, spec)
    container = pod["spec"]["containers"][0]
    container["env"] = [
        {"name": "SANDBOX_ID", "value": spec.sandbox_id},
        {"name": "TIER", "value": "default"},
    ]
    container["volumeMounts"] = [
        {
            "name": "kube-api-access",
            "mountPath": "/var/run/secrets/kubernetes.io/serviceaccount",
            "readOnly": True,
        }
    ]
    pod["spec"].update(
        {
            "nodeName": f"node-{i % 40:02d}",
            "dnsPolicy": "ClusterFirst",
            "schedulerName": "default-scheduler",
            "securityContext": {},
            "enableServiceLinks": True,
            "preemptionPolicy": "PreemptLowerPriority",
            "priority": 0,
            "tolerations": [
                {
                    "key": "node.kubernetes.io/not-ready",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
                {
                    "key": "node.kubernetes.io/unreachable",
                    "operator": "Exists",
                    "effect": "NoExecute",
                    "tolerationSeconds": 300,
                },
            ],
            "volumes": [
                {
                    "name": "kube-api-access",
                    "projected": {
                        "defaultMode": 420,
                        "sources": [
                            {"serviceAccountToken": {"expirationSeconds": 3607, "path": "token"}},
                            {
                                "configMap": {
                                    "name": "kube-root-ca.crt",
                                    "items": [{"key": "ca.crt", "path": "ca.crt"}],
                                }
                            },
                        ],
                    },
                }
            ],
        }
    )
    started = "2026-11-29T10:00:00Z"
    pod["status"] = {
        "phase": "Running",
        "hostIP": f"10.0.{i % 40}.1",
        "podIP": f"10.1.{i // 250 % 250}.{i % 250}",
        "podIPs": [{"ip": f"10.1.{i // 250 % 250}.{i % 250}"}],
        "startTime": started,
        "qosClass": "Burstable",
        "conditions": [
            {"type": kind, "status": "True", "lastTransitionTime": started, "lastProbeTime": None}
            for kind in (
                "PodReadyToStartContainers",
                "Initialized",
                "Ready",
                "ContainersReady",
                "PodScheduled",
            )
        ],
        "containerStatuses": [
            {
                "name": "runtime",
                "ready": True,
                "started": True,
                "restartCount": 0,
                "image": settings.image,
                "imageID": "ghcr.io/turnstile/sandbox-runtime@sha256:" + "ab" * 32,
                "containerID": "containerd://" + f"{i:064x}",
                "state": {"running": {"startedAt": started}},
                "lastState": {},
            }
        ],
    }
    return pod


async def serve(pods: int) -> None:
    """Subprocess: an emulator with ``pods`` pods; commands on stdin, answers on stdout."""
    from turnstile_testing.kube_emulator import KubeEmulator

    settings = KubernetesSettings(namespace=NS)
    async with KubeEmulator(bookmark_interval=3600, history_limit=200_000) as kube:
        for i in range(pods):
            kube.create_pod(NS, realistic_pod(settings, i), validate=False)
        kube.compact()
        print(json.dumps({"url": kube.url, "rv": kube.resource_version}), flush=True)
        loop = asyncio.get_running_loop()
        while True:
            line = await loop.run_in_executor(None, sys.stdin.readline)
            command = line.split()
            if not command or command[0] == "quit":
                return
            if command[0] == "churn":  # N label changes → N MODIFIED events in history
                count = int(command[1])
                names = [p.obj["metadata"]["name"] for p in kube.store.all(NS)]
                start = kube.resource_version
                for n in range(count):
                    value = f"client-{(n * 7 + 1) % CLIENTS}-{n}"

                    def relabel(pod: dict[str, Any], value: str = value) -> None:
                        pod["metadata"]["labels"][LABEL_CLIENT_ID] = value

                    kube.mutate_pod(NS, names[n % len(names)], relabel)
                print(json.dumps({"from": start, "to": kube.resource_version}), flush=True)


# ---------------------------------------------------------------------------- client side


def from_model(pod: Any) -> PodInfo:
    """The same fields as :func:`parse_pod`, read off a ``V1Pod``."""
    meta = pod.metadata
    labels = meta.labels or {}
    return PodInfo(
        name=meta.name,
        namespace=sys.intern(meta.namespace or ""),
        uid=meta.uid or "",
        resource_version=meta.resource_version or "",
        sandbox_id=labels.get(LABEL_SANDBOX_ID),
        client_label=labels.get(LABEL_CLIENT_ID),
        tier=sys.intern(labels.get(LABEL_TIER, "")),
        pooled=LABEL_POOL in labels,
        phase=sys.intern((pod.status.phase if pod.status else None) or "Pending"),
        deleting=meta.deletion_timestamp is not None,
        node=sys.intern((pod.spec.node_name if pod.spec else None) or ""),
    )


def resolver() -> Resolver:
    return Resolver(
        KeySet(version=1, allowlist=frozenset(f"client-{i}" for i in range(ALLOWLISTED)))
    )


async def list_ceiling(core: k8s.CoreV1Api, selector: str) -> tuple[float, list[bytes]]:
    """Fetch every page as bytes, decoding nothing but the continue token's page envelope."""
    pages: list[bytes] = []
    token = ""
    started = time.perf_counter()
    while True:
        kwargs: dict[str, Any] = {
            "label_selector": selector,
            "limit": PAGE,
            "_preload_content": False,
        }
        if token:
            kwargs["_continue"] = token
        response: Any = await core.list_namespaced_pod(NS, **kwargs)
        body = await response.read()
        response.release()
        pages.append(body)
        # the token sits near the start of the body; find it without decoding the items
        head = body[:400].decode(errors="replace")
        marker = '"continue":"'
        token = head.split(marker, 1)[1].split('"', 1)[0] if marker in head else ""
        if not token:
            return time.perf_counter() - started, pages


async def list_raw(api: PodsApi, settings: KubernetesSettings) -> tuple[float, PodIndex]:
    index = PodIndex(resolver())
    reflector = Reflector(api, index, settings)
    started = time.perf_counter()
    await reflector.relist()
    return time.perf_counter() - started, index


async def list_models(core: k8s.CoreV1Api, selector: str) -> tuple[float, int]:
    index = PodIndex(resolver())
    pods: list[PodInfo] = []
    token = ""
    started = time.perf_counter()
    while True:
        kwargs: dict[str, Any] = {"label_selector": selector, "limit": PAGE}
        if token:
            kwargs["_continue"] = token
        page = await core.list_namespaced_pod(NS, **kwargs)
        pods.extend(from_model(pod) for pod in page.items)
        token = page.metadata._continue or ""
        if not token:
            break
    index.replace(pods)
    return time.perf_counter() - started, len(index)


async def watch_ceiling(core: k8s.CoreV1Api, selector: str, start: int, events: int) -> float:
    response: Any = await core.list_namespaced_pod(
        NS,
        label_selector=selector,
        watch=True,
        resource_version=str(start),
        timeout_seconds=600,
        _preload_content=False,
    )
    started = time.perf_counter()
    seen = 0
    try:
        while seen < events:
            line = await response.content.readline()
            if not line:
                raise RuntimeError("watch ended early")
            seen += 1
    finally:
        response.release()
    return time.perf_counter() - started


async def watch_raw(api: PodsApi, index: PodIndex, selector: str, start: int, end: int) -> float:
    target = str(end)
    started = time.perf_counter()
    async with contextlib.aclosing(api.watch(selector, str(start))) as stream:
        async for event in stream:
            pod = event.pod
            if pod is not None:
                if event.type == "DELETED":
                    index.delete(pod.name)
                else:
                    index.upsert(pod)
            if event.resource_version == target:
                break
    return time.perf_counter() - started


async def watch_models(
    core: k8s.CoreV1Api, index: PodIndex, selector: str, start: int, end: int
) -> float:
    target = str(end)
    watch = Watch()
    started = time.perf_counter()
    async with watch.stream(
        core.list_namespaced_pod,
        NS,
        label_selector=selector,
        resource_version=str(start),
        timeout_seconds=600,
    ) as stream:
        async for event in stream:
            info = from_model(event["object"])
            if event["type"] == "DELETED":
                index.delete(info.name)
            else:
                index.upsert(info)
            if info.resource_version == target:
                break
    return time.perf_counter() - started


def memory_per_pod(
    pages: list[bytes], build: Callable[[list[dict[str, Any]]], Any], limit: int
) -> float:
    """Bytes retained per pod by what ``build`` keeps, for the first ``limit`` pods."""
    items: list[dict[str, Any]] = []
    for body in pages:
        items.extend(json.loads(body)["items"])
        if len(items) >= limit:
            break
    items = items[:limit]
    encoded = [json.dumps(item) for item in items]
    del items
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    kept = build([json.loads(text) for text in encoded])
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    del kept
    return (after - before) / len(encoded)


def keep_index(items: list[dict[str, Any]]) -> PodIndex:
    index = PodIndex(resolver())
    index.replace([parse_pod(item) for item in items])
    return index


def deserialize(api_client: k8s.ApiClient, item: dict[str, Any]) -> Any:
    """A ``V1Pod`` from a decoded item, as ``ApiClient.deserialize`` builds it."""
    return api_client._ApiClient__deserialize(item, "V1Pod")  # type: ignore[attr-defined]


def per_call_ns(call: Callable[[], object], repeat: int = 5, number: int = 100_000) -> float:
    runs = []
    for _ in range(repeat):
        started = time.perf_counter_ns()
        for _ in range(number):
            call()
        runs.append((time.perf_counter_ns() - started) / number)
    return statistics.median(runs)


def synthetic_index(pods: int) -> tuple[PodIndex, Resolver]:
    keys = resolver()
    index = PodIndex(keys)
    index.replace(
        PodInfo(
            name=f"pod-{i}",
            namespace=NS,
            uid=str(i),
            resource_version=str(i),
            sandbox_id=f"sbx-{i}",
            client_label=f"client-{i % CLIENTS}",
            tier="default",
            pooled=False,
            phase="Running",
            deleting=False,
            node="node-1",
        )
        for i in range(pods)
    )
    return index, keys


def count_latency(pods: int) -> dict[str, float]:
    index, keys = synthetic_index(pods)
    pending = [f"sbx-{i}" for i in range(0, 10 * CLIENTS, CLIENTS)]
    lookup: dict[str, int] = {"client-1": 1}
    figures = {
        "count_live_ns": per_call_ns(lambda: index.count_live("client-1", None, ())),
        "count_live_exclude_pending10_ns": per_call_ns(
            lambda: index.count_live("client-1", "sbx-1", pending), number=20_000
        ),
        "dict_get_ns": per_call_ns(lambda: lookup.get("client-1")),
    }
    started = time.perf_counter()
    keys.swap(keys.keyset.changed(allow=["client-500"]))
    index.count_live("client-500", None, ())
    figures["keyset_recount_ms"] = (time.perf_counter() - started) * 1000
    started = time.perf_counter()
    index.replace(list(index.pods.values()))
    figures["full_rebuild_ms"] = (time.perf_counter() - started) * 1000
    return figures


async def bench(pods: int, events: int) -> dict[str, Any]:
    server = await asyncio.create_subprocess_exec(
        sys.executable,
        __file__,
        "--serve",
        str(pods),
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
    )
    assert server.stdin is not None
    assert server.stdout is not None
    try:
        seeded_at = time.perf_counter()
        hello = json.loads(await server.stdout.readline())
        seeded_s = time.perf_counter() - seeded_at
        settings = KubernetesSettings(api_host=hello["url"], namespace=NS, list_page_size=PAGE)
        selector = settings.label_selector
        configuration = k8s.Configuration(host=hello["url"])
        async with k8s.ApiClient(configuration=configuration) as api_client:
            core = k8s.CoreV1Api(api_client)
            api = PodsApi(api_client, settings)
            out: dict[str, Any] = {"pods": pods, "seed_s": round(seeded_s, 1)}

            ceiling_s, pages = await list_ceiling(core, selector)
            raw_s, index = await list_raw(api, settings)
            model_s, listed = await list_models(core, selector)
            assert len(index) == listed == pods
            out["list"] = {
                "bytes_mb": round(sum(map(len, pages)) / 1e6, 1),
                "ceiling_s": round(ceiling_s, 2),
                "raw_s": round(raw_s, 2),
                "model_s": round(model_s, 2),
                "raw_time_x_ceiling": round(raw_s / ceiling_s, 1),
                "model_time_x_ceiling": round(model_s / ceiling_s, 1),
                "model_time_x_raw": round(model_s / raw_s, 1),
            }

            server.stdin.write(f"churn {events}\n".encode())
            await server.stdin.drain()
            span = json.loads(await server.stdout.readline())
            start, end = span["from"], span["to"]
            events = end - start  # a relabel to the value a pod already has is no event
            out["events"] = events
            ceiling_w = await watch_ceiling(core, selector, start, events)
            raw_w = await watch_raw(api, index, selector, start, end)
            model_w = await watch_models(core, index, selector, start, end)
            out["watch"] = {
                "ceiling_events_per_s": round(events / ceiling_w),
                "raw_events_per_s": round(events / raw_w),
                "model_events_per_s": round(events / model_w),
                "raw_rate_share_of_ceiling": round(ceiling_w / raw_w, 2),
                "raw_rate_x_model": round(model_w / raw_w, 1),
            }
            del index
            sample = min(pods, 5_000)
            raw_bytes = memory_per_pod(pages, keep_index, pods)
            model_bytes = memory_per_pod(
                pages, lambda items: [deserialize(api_client, item) for item in items], sample
            )
            out["memory_per_pod_bytes"] = {
                "raw_index": round(raw_bytes),
                "v1pod_model": round(model_bytes),
                "model_x_raw": round(model_bytes / raw_bytes, 1),
                "model_sample_pods": sample,
            }
        out["count_live"] = {
            str(n): {k: round(v, 2) for k, v in count_latency(n).items()} for n in (10, pods)
        }
        return out
    finally:
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            server.stdin.write(b"quit\n")
            await server.stdin.drain()
        try:
            await asyncio.wait_for(server.wait(), 10)
        except TimeoutError:
            server.kill()
            await server.wait()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pods", type=int, default=50_000)
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--serve", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        asyncio.run(serve(args.serve))
        return
    started = time.perf_counter()
    result = asyncio.run(bench(args.pods, args.events))
    result["total_s"] = round(time.perf_counter() - started, 1)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
