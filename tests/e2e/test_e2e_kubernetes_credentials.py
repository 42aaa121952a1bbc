"""Worker attestation on Kubernetes across the real services (SPEC Z3): admission, the
substrate on the API-server emulator (with a signing key) and the affinity relay enforcing
attestation, all over gRPC with real Redis and PostgreSQL.

Activate puts each pod's credential in a Secret the pod mounts; a real worker process given
that Secret's credential (the test writes the file the kubelet would project) attaches, the
credential is refused for another sandbox, and after Deactivate the Secret is gone and the
credential refused.
"""

from __future__ import annotations

import asyncio
import base64
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio
import pytest

from turnstile_affinity.app import create_app as create_affinity
from turnstile_affinity.settings import AffinitySettings
from turnstile_contracts import (
    affinity_pb2,
    affinity_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.errors import RichError, decode
from turnstile_substrate.runtime import LABEL_SANDBOX_ID
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.plugin import CredentialKeyFiles

from .kube_stack import NAMESPACE, kube_services


@dataclass
class Stack:
    kube: KubeEmulator
    substrate: substrate_pb2_grpc.SubstrateServiceAsyncStub
    affinity: affinity_pb2_grpc.AffinityServiceAsyncStub
    affinity_addr: str

    def pod_of(self, sandbox_id: str) -> dict[str, Any]:
        (pod,) = [
            p
            for p in self.kube.pods(NAMESPACE)
            if p["metadata"]["labels"].get(LABEL_SANDBOX_ID) == sandbox_id
        ]
        return pod

    def credential_of(self, pod_name: str) -> str | None:
        secret = self.kube.secret(NAMESPACE, f"{pod_name}-credential")
        if secret is None:
            return None
        return base64.b64decode(secret["data"]["credential"]).decode()


@pytest.fixture
async def stack(
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    credential_keys: CredentialKeyFiles,
    monkeypatch: pytest.MonkeyPatch,
) -> AsyncIterator[Stack]:
    async with kube_services(
        redis_url,
        redis_prefix,
        database_url,
        monkeypatch,
        substrate={
            "health_check_interval_s": 0.1,
            "worker_credential_signing_key_file": credential_keys.signing_key_file,
        },
    ) as services:
        affinity_app = await create_affinity(
            AffinitySettings.model_validate(
                {
                    **services.common,
                    "port": 0,
                    "wake_enabled": False,
                    "heartbeat_interval_s": 0.2,
                    "presence_ttl_s": 5.0,
                    "worker_attestation": "enforce",
                    "worker_credential_public_keys_file": credential_keys.public_keys_file,
                }
            )
        )
        await affinity_app.start()
        try:
            async with (
                grpc.aio.insecure_channel(services.substrates[0].address) as sub,
                grpc.aio.insecure_channel(affinity_app.address) as aff,
            ):
                yield Stack(
                    services.kube,
                    substrate_pb2_grpc.SubstrateServiceStub(sub),
                    affinity_pb2_grpc.AffinityServiceStub(aff),
                    affinity_app.address,
                )
        finally:
            await affinity_app.stop()


async def _eventually(probe: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
    """Poll another process's state: no event crosses the process boundary."""
    async with asyncio.timeout(timeout_s):
        while not await probe():  # noqa: ASYNC110 - another process's state
            await asyncio.sleep(0.05)


async def _hello(
    stub: affinity_pb2_grpc.AffinityServiceAsyncStub, sandbox_id: str, credential: str
) -> RichError:
    call = stub.Attach(None)
    hello = affinity_pb2.Hello(sandbox_id=sandbox_id, capacity=1, credential=credential)
    await call.write(affinity_pb2.AttachRequest(hello=hello))
    with pytest.raises(grpc.aio.AioRpcError) as raised:
        await call.read()
    return decode(raised.value)


async def _activate(stack: Stack, sandbox_id: str) -> None:
    await stack.substrate.Activate(
        substrate_pb2.ActivateRequest(
            sandbox_id=sandbox_id, client=common_pb2.ActivationClient(client_id="acme")
        )
    )


@pytest.mark.timeout(120)
async def test_activate_delivers_a_mounted_credential_a_worker_attaches_with_and_deactivate_revokes(
    stack: Stack, tmp_path: Path
) -> None:
    await _activate(stack, "sb-a")
    await _activate(stack, "sb-b")
    pod_a = stack.pod_of("sb-a")
    name_a = pod_a["metadata"]["name"]
    credential = stack.credential_of(name_a)
    assert credential is not None
    assert stack.credential_of(stack.pod_of("sb-b")["metadata"]["name"]) is not None
    assert credential not in str(pod_a)

    mounted = tmp_path / "credential"
    mounted.write_text(credential)
    environment = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("TURNSTILE_WORKER_", "TURNSTILE_AFFINITY_ADDR"))
    }
    environment.update(
        TURNSTILE_AFFINITY_ADDR=stack.affinity_addr,
        TURNSTILE_WORKER_SANDBOX_ID="sb-a",
        TURNSTILE_WORKER_CREDENTIAL_FILE=str(mounted),
        TURNSTILE_WORKER_RECONNECT_MAX_S="0.2",
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "turnstile_affinity.worker",
        env=environment,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:

        async def attached() -> bool:
            listed = await stack.affinity.ListWorkers(affinity_pb2.ListWorkersRequest())
            return "sb-a" in {w.sandbox_id for w in listed.workers}

        await _eventually(attached)
        impostor = await _hello(stack.affinity, "sb-b", credential)
        assert impostor.code is grpc.StatusCode.PERMISSION_DENIED
        assert impostor.metadata["why"] == "wrong_sandbox"
    finally:
        proc.kill()
        await proc.wait()

    await stack.substrate.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-a"))

    assert stack.credential_of(name_a) is None
    revoked = await _hello(stack.affinity, "sb-a", credential)
    assert revoked.code is grpc.StatusCode.PERMISSION_DENIED
    assert revoked.metadata["why"] == "revoked"
