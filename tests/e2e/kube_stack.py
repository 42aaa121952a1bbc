"""The real admission and substrate services on the Kubernetes substrate, against the
API-server emulator: the set-up the end-to-end Kubernetes tests share.

:func:`kube_services` migrates the database, starts an emulator, points the substrate's
``TURNSTILE_K8S_*`` settings at it, and starts ``replicas`` substrate services and one
admission service wired to each other over real sockets; everything is stopped on exit,
even when the test failed. Each test adds what it needs on top (an affinity service,
channels, its own checks); settings a test cares about are passed as overrides.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_admission.app import create_app as create_admission
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import common_pb2, substrate_pb2, substrate_pb2_grpc
from turnstile_platform.errors import RichError, decode
from turnstile_platform.server import GrpcService
from turnstile_substrate.app import create_app as create_substrate
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator import KubeEmulator, KubeletConfig
from turnstile_testing.processes import free_port

#: The namespace sandbox pods go to.
NAMESPACE = "sandboxes"

#: A cluster that schedules and starts pods, deletes them gracefully, and enforces the
#: sandbox namespace's restricted Pod Security level on what the substrate creates.
RUNNING_CLUSTER: Mapping[str, Any] = {
    "bookmark_interval": 0.2,
    "graceful_deletion": True,
    "kubelet": KubeletConfig(start_delay=0.01, stop_delay=0.05),
    "pod_security": "restricted",
}
#: An API server alone: pods are stored, never scheduled or started.
API_ONLY: Mapping[str, Any] = {"bookmark_interval": 0.2}


@dataclass
class KubeServices:
    kube: KubeEmulator
    substrates: list[GrpcService]
    admission: GrpcService
    #: The settings every service of the stack shares (an affinity service a test adds, say).
    common: dict[str, object] = field(default_factory=dict)


def common_settings(redis_url: str, redis_prefix: str) -> dict[str, object]:
    """Settings every service of an end-to-end stack shares."""
    return {
        "host": "127.0.0.1",
        "metrics_port": 0,
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
        "client_allowlist": ("acme",),
        "shutdown_grace_s": 1.0,
        "log_format": "text",
    }


@contextlib.asynccontextmanager
async def kube_services(
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    monkeypatch: pytest.MonkeyPatch,
    *,
    replicas: int = 1,
    cluster: Mapping[str, Any] = RUNNING_CLUSTER,
    substrate: Mapping[str, object] | None = None,
    admission: Mapping[str, object] | None = None,
    before_admission: Callable[[], Awaitable[None]] | None = None,
    on_kube: Callable[[KubeEmulator], object] | None = None,
) -> AsyncIterator[KubeServices]:
    """``replicas`` substrate services (Kubernetes, on a fresh emulator built with
    ``cluster``) and one admission service; ``substrate`` and ``admission`` override their
    settings. ``before_admission`` runs after the substrates started, before admission;
    ``on_kube`` gets the emulator before anything talks to it (to inject faults)."""
    await asyncio.to_thread(apply_migrations, database_url)
    async with KubeEmulator(**cluster) as kube:
        if on_kube is not None:
            on_kube(kube)
        monkeypatch.setenv("TURNSTILE_K8S_API_HOST", kube.url)
        monkeypatch.setenv("TURNSTILE_K8S_NAMESPACE", NAMESPACE)
        admission_port = free_port()
        common = common_settings(redis_url, redis_prefix)
        apps: list[GrpcService] = []
        try:
            substrates = []
            for _ in range(replicas):
                app = await create_substrate(
                    SubstrateSettings.model_validate(
                        {
                            **common,
                            "port": 0,
                            "substrate_kind": "kubernetes",
                            "database_url": database_url,
                            "admission_addr": f"127.0.0.1:{admission_port}",
                            **(substrate or {}),
                        }
                    )
                )
                await app.start()
                apps.append(app)
                substrates.append(app)
            if before_admission is not None:
                await before_admission()
            admission_app = await create_admission(
                AdmissionSettings.model_validate(
                    {
                        **common,
                        "port": admission_port,
                        "substrate_addr": substrates[0].address,
                        **(admission or {}),
                    }
                )
            )
            await admission_app.start()
            apps.insert(0, admission_app)  # stopped first: it calls the substrates
            yield KubeServices(kube, substrates, admission_app, common)
        finally:  # a failed test must not leave services running against a closed emulator
            for app in apps:
                await app.stop()


async def activate_for_acme(
    stub: substrate_pb2_grpc.SubstrateServiceAsyncStub, sandbox_id: str
) -> substrate_pb2.ActivateResponse | RichError:
    """Activate ``sandbox_id`` for the allowlisted client ``acme``: the answer, or the
    decoded error (a refusal is a result these tests count)."""
    try:
        return await stub.Activate(
            substrate_pb2.ActivateRequest(
                sandbox_id=sandbox_id, client=common_pb2.ActivationClient(client_id="acme")
            )
        )
    except grpc.aio.AioRpcError as error:
        return decode(error)
