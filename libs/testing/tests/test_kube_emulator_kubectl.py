"""Fidelity checks: the real kubectl, pointed at the emulator, must work as against a cluster."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from turnstile_testing.kube_emulator import KubeEmulator, KubeletConfig
from turnstile_testing.kube_emulator import pod_manifest as pod_body
from turnstile_testing.kubectl import KUBECTL, Result, kubectl_argv, kubectl_env, run_kubectl

pytestmark = pytest.mark.skipif(
    KUBECTL is None, reason="kubectl is not installed; the fidelity checks need the real client"
)

Kubectl = Callable[..., Awaitable[Result]]


def _argv(kube: KubeEmulator, home: Path, args: tuple[str, ...]) -> list[str]:
    return kubectl_argv(kube.url, home, "ns", args)


def _env(home: Path) -> dict[str, str]:
    return kubectl_env(home)


@pytest.fixture
def kubectl(kube: KubeEmulator, tmp_path: Path) -> Kubectl:
    async def run(*args: str) -> Result:
        return await run_kubectl(kube.url, tmp_path, "ns", *args)

    return run


@pytest.fixture
def seeded(kube: KubeEmulator) -> KubeEmulator:
    kube.create_pod("ns", pod_body("web-1", {"app": "web", "tier": "front"}))
    kube.create_pod("ns", pod_body("web-2", {"app": "web"}))
    kube.create_pod("ns", pod_body("db-1", {"app": "db"}))
    return kube


def names(output: str) -> list[str]:
    return [item["metadata"]["name"] for item in json.loads(output)["items"]]


@pytest.mark.parametrize(
    ("selector", "expected"),
    [
        ("app=web", ["web-1", "web-2"]),
        ("app in (web,db),!tier", ["db-1", "web-2"]),
        ("app!=web", ["db-1"]),
        ("tier", ["web-1"]),
    ],
)
async def test_kubectl_get_with_a_label_selector(
    seeded: KubeEmulator, kubectl: Kubectl, selector: str, expected: list[str]
) -> None:
    code, out, err = await kubectl("get", "pods", "-l", selector, "-o", "json")

    assert code == 0, err
    assert names(out) == expected


async def test_kubectl_get_with_a_field_selector(seeded: KubeEmulator, kubectl: Kubectl) -> None:
    seeded.set_pod_phase("ns", "db-1", "Running")

    code, out, err = await kubectl(
        "get", "pods", "--field-selector", "status.phase=Running", "-o", "json"
    )

    assert code == 0, err
    assert names(out) == ["db-1"]


async def test_kubectl_get_missing_pod_reports_not_found(
    seeded: KubeEmulator, kubectl: Kubectl
) -> None:
    code, _, err = await kubectl("get", "pod", "ghost", "-o", "json")

    assert code != 0
    assert 'pods "ghost" not found' in err


async def test_kubectl_label_patches_the_pod(seeded: KubeEmulator, kubectl: Kubectl) -> None:
    code, out, err = await kubectl("label", "pod", "web-2", "tier=back")

    assert code == 0, err
    assert "labeled" in out
    assert seeded.pod("ns", "web-2")["metadata"]["labels"] == {"app": "web", "tier": "back"}  # type: ignore[index]
    patches = [r for r in seeded.requests if r.method == "PATCH"]
    assert [p.content_type for p in patches] == ["application/merge-patch+json"]


async def test_kubectl_label_with_a_stale_resource_version_conflicts(
    seeded: KubeEmulator, kubectl: Kubectl
) -> None:
    seeded.set_pod_phase("ns", "web-1", "Running")  # moves web-1 past version 1

    code, _, err = await kubectl("label", "pod", "web-1", "claimed=yes", "--resource-version=1")

    assert code != 0
    assert "the object has been modified" in err
    assert "claimed" not in seeded.pod("ns", "web-1")["metadata"]["labels"]  # type: ignore[index]


async def test_kubectl_delete_waits_for_the_pod_to_go(
    seeded: KubeEmulator, kubectl: Kubectl
) -> None:
    code, out, err = await kubectl("delete", "pod", "db-1")

    assert code == 0, err
    assert 'pod "db-1" deleted' in out
    assert seeded.pod("ns", "db-1") is None


@pytest.fixture
async def watching_kubectl(
    seeded: KubeEmulator, tmp_path: Path
) -> AsyncIterator[asyncio.subprocess.Process]:
    proc = await asyncio.create_subprocess_exec(
        *_argv(seeded, tmp_path, ("get", "pods", "--watch", "-o", "json", "--output-watch-events")),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        env=_env(tmp_path),
    )
    try:
        yield proc
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()


async def read_events(proc: asyncio.subprocess.Process, count: int) -> list[dict[str, Any]]:
    """Decode ``count`` pretty-printed JSON documents from kubectl's stdout."""
    assert proc.stdout is not None
    decoder = json.JSONDecoder()
    buffer = ""
    events: list[dict[str, Any]] = []
    async with asyncio.timeout(20):
        while len(events) < count:
            chunk = await proc.stdout.read(65536)
            assert chunk, "kubectl stopped before printing the expected events"
            buffer += chunk.decode()
            while True:
                stripped = buffer.lstrip()
                if not stripped:
                    break
                try:
                    event, end = decoder.raw_decode(stripped)
                except ValueError:
                    break
                events.append(event)
                buffer = stripped[end:]
    return events


async def test_kubectl_watch_prints_added_modified_and_deleted(
    seeded: KubeEmulator, watching_kubectl: asyncio.subprocess.Process
) -> None:
    initial = await read_events(watching_kubectl, 3)
    await seeded.wait_for_watches(1)
    seeded.mutate_pod("ns", "web-1", lambda p: p["metadata"]["labels"].update(seen="yes"))
    seeded.delete_pod("ns", "db-1")
    later = await read_events(watching_kubectl, 2)

    assert sorted((e["type"], e["object"]["metadata"]["name"]) for e in initial) == [
        ("ADDED", "db-1"),
        ("ADDED", "web-1"),
        ("ADDED", "web-2"),
    ]
    assert [(e["type"], e["object"]["metadata"]["name"]) for e in later] == [
        ("MODIFIED", "web-1"),
        ("DELETED", "db-1"),
    ]
    assert later[0]["object"]["metadata"]["labels"]["seen"] == "yes"
    watch_requests = [r for r in seeded.requests if r.is_watch]
    assert watch_requests[0].query["resourceVersion"] == "3"


def _lease(name: str, holder: str) -> dict[str, Any]:
    return {
        "metadata": {"name": name, "labels": {"app": "turnstile"}},
        "spec": {"holderIdentity": holder, "leaseDurationSeconds": 15, "leaseTransitions": 0},
    }


async def test_kubectl_gets_and_lists_leases(kube: KubeEmulator, kubectl: Kubectl) -> None:
    kube.leases.create("ns", _lease("leader", "replica-a"))
    kube.leases.create("other", _lease("elsewhere", "replica-b"))

    code, out, err = await kubectl("get", "leases", "-o", "json")
    assert code == 0, err
    assert names(out) == ["leader"]
    code, out, err = await kubectl("get", "lease.coordination.k8s.io", "leader", "-o", "json")
    assert code == 0, err
    assert json.loads(out)["spec"]["holderIdentity"] == "replica-a"


async def test_kubectl_get_missing_lease_reports_not_found(
    kube: KubeEmulator, kubectl: Kubectl
) -> None:
    code, _, err = await kubectl("get", "lease", "ghost")

    assert code != 0
    assert 'leases.coordination.k8s.io "ghost" not found' in err


async def test_kubectl_label_on_a_lease_with_a_stale_version_conflicts(
    kube: KubeEmulator, kubectl: Kubectl
) -> None:
    created = kube.leases.create("ns", _lease("leader", "replica-a"))
    stale = created["metadata"]["resourceVersion"]
    code, _, err = await kubectl("label", "lease", "leader", "seen=yes")
    assert code == 0, err

    code, _, err = await kubectl(
        "label", "lease", "leader", "again=yes", f"--resource-version={stale}"
    )

    assert code != 0
    assert "the object has been modified" in err
    labels = kube.lease("ns", "leader")["metadata"]["labels"]  # type: ignore[index]
    assert labels == {"app": "turnstile", "seen": "yes"}


async def test_kubectl_delete_lease(kube: KubeEmulator, kubectl: Kubectl) -> None:
    kube.leases.create("ns", _lease("leader", "replica-a"))

    code, out, err = await kubectl("delete", "lease", "leader")

    assert code == 0, err
    assert "deleted" in out
    assert kube.lease("ns", "leader") is None


async def test_kubectl_creates_gets_and_lists_secrets_by_label(
    kube: KubeEmulator, kubectl: Kubectl
) -> None:
    # (kubectl's typed create sends protobuf, which the emulator does not speak)
    kube.secrets.create("ns", {"metadata": {"name": "cred-a"}, "data": {"credential": "YWJj"}})
    code, _, err = await kubectl("label", "secret", "cred-a", "turnstile.dev/sandbox-id=a")
    assert code == 0, err
    kube.secrets.create("ns", {"metadata": {"name": "other"}, "stringData": {"x": "y"}})

    code, out, err = await kubectl("get", "secrets", "-l", "turnstile.dev/sandbox-id", "-o", "json")
    assert code == 0, err
    assert names(out) == ["cred-a"]
    code, out, err = await kubectl("get", "secret", "other", "-o", "json")
    assert code == 0, err
    got = json.loads(out)
    assert got["type"] == "Opaque"
    assert got["data"] == {"x": "eQ=="}


async def test_kubectl_get_missing_secret_reports_not_found(
    kube: KubeEmulator, kubectl: Kubectl
) -> None:
    code, _, err = await kubectl("get", "secret", "ghost")

    assert code != 0
    assert 'secrets "ghost" not found' in err


async def test_kubectl_patch_and_delete_secret(kube: KubeEmulator, kubectl: Kubectl) -> None:
    kube.secrets.create("ns", {"metadata": {"name": "cred"}, "data": {"credential": "YQ=="}})

    code, _, err = await kubectl(
        "patch", "secret", "cred", "--type=merge", "-p", '{"data":{"credential":"Yg=="}}'
    )
    assert code == 0, err
    assert kube.secret("ns", "cred")["data"] == {"credential": "Yg=="}  # type: ignore[index]
    code, out, err = await kubectl("delete", "secret", "cred")

    assert code == 0, err
    assert "deleted" in out
    assert kube.secret("ns", "cred") is None


@pytest.fixture
async def cluster() -> AsyncIterator[KubeEmulator]:
    config = KubeletConfig(nodes=("n1",), start_delay=0.01, stop_delay=0.2)
    async with KubeEmulator(
        graceful_deletion=True, kubelet=config, pod_security="restricted"
    ) as emulator:
        yield emulator


@pytest.fixture
def kubectl_cluster(cluster: KubeEmulator, tmp_path: Path) -> Kubectl:
    async def run(*args: str) -> Result:
        proc = await asyncio.create_subprocess_exec(
            *_argv(cluster, tmp_path, args),
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env=_env(tmp_path),
        )
        out, err = await asyncio.wait_for(proc.communicate(), 30)
        assert proc.returncode is not None
        return proc.returncode, out.decode(), err.decode()

    return run


RESTRICTED_POD = {
    "apiVersion": "v1",
    "kind": "Pod",
    "metadata": {"name": "tight"},
    "spec": {
        "securityContext": {"runAsNonRoot": True, "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [
            {
                "name": "main",
                "image": "busybox:1.36",
                "securityContext": {
                    "allowPrivilegeEscalation": False,
                    "capabilities": {"drop": ["ALL"]},
                },
            }
        ],
    },
}


async def test_kubectl_run_is_refused_by_restricted_pod_security(
    cluster: KubeEmulator, kubectl_cluster: Kubectl
) -> None:
    code, _, err = await kubectl_cluster("run", "loose", "--image=busybox:1.36")

    assert code != 0
    assert 'violates PodSecurity "restricted:latest"' in err
    assert cluster.pod("ns", "loose") is None


async def test_kubectl_waits_for_the_kubelet_then_sees_graceful_deletion(
    cluster: KubeEmulator, kubectl_cluster: Kubectl, tmp_path: Path
) -> None:
    manifest = tmp_path / "pod.json"
    manifest.write_text(json.dumps(RESTRICTED_POD))
    code, _, err = await kubectl_cluster("create", "--validate=false", "-f", str(manifest))
    assert code == 0, err

    code, out, err = await kubectl_cluster(
        "wait", "--for=condition=Ready", "pod/tight", "--timeout=20s"
    )
    assert code == 0, err
    assert "condition met" in out

    code, out, err = await kubectl_cluster("delete", "pod", "tight", "--wait=false")
    assert code == 0, err
    code, out, err = await kubectl_cluster("get", "pod", "tight", "-o", "json")
    if code == 0:  # still terminating (the kubelet stops it a moment later)
        assert json.loads(out)["metadata"]["deletionTimestamp"]
    code, out, err = await kubectl_cluster("wait", "--for=delete", "pod/tight", "--timeout=20s")
    assert code == 0, err
    assert cluster.pod("ns", "tight") is None


async def test_kubectl_raw_list_at_a_future_version_waits(
    kube: KubeEmulator, kubectl: Kubectl
) -> None:
    kube.create_pod("ns", pod_body("p1"))
    future = kube.resource_version + 1
    listing = asyncio.ensure_future(
        kubectl("get", "--raw", f"/api/v1/namespaces/ns/pods?resourceVersion={future}")
    )
    async with asyncio.timeout(20):
        await kube.store.version_waited.wait()
    kube.create_pod("ns", pod_body("p2"))
    code, out, err = await listing

    assert code == 0, err
    assert names(out) == ["p1", "p2"]
