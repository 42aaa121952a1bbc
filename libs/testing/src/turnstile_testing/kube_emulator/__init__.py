"""A test-only Kubernetes API server that real clients talk to over HTTP.

``KubeEmulator`` serves the core/v1 pod endpoints with the API server's semantics for
resourceVersion, selectors, watch (replay, bookmarks, timeouts, 410 Expired), patches and
optimistic concurrency, and ``coordination.k8s.io/v1`` Leases; opt-in, graceful deletion, a
scheduler/kubelet loop and Pod Security admission; plus hooks a test uses to make the world
misbehave (cut watches, compact history, inject failures, move pods through phases). See
``server.py`` for the API.
"""

from turnstile_testing.kube_emulator.errors import ApiError
from turnstile_testing.kube_emulator.faults import Fault
from turnstile_testing.kube_emulator.kubelet import KubeletConfig
from turnstile_testing.kube_emulator.manifests import pod_manifest
from turnstile_testing.kube_emulator.selectors import FieldSelector, LabelSelector, PodFilter
from turnstile_testing.kube_emulator.server import KubeEmulator, RecordedRequest
from turnstile_testing.kube_emulator.store import PodStore

__all__ = [
    "ApiError",
    "Fault",
    "FieldSelector",
    "KubeEmulator",
    "KubeletConfig",
    "LabelSelector",
    "PodFilter",
    "PodStore",
    "RecordedRequest",
    "pod_manifest",
]
