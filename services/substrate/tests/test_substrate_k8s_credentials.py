"""Sandbox credentials on Kubernetes (SPEC Z3): a Secret per pod, mounted, renewed by the leader.

The substrate runs on the API-server emulator with a real issuer (real Redis record); the
relay is the real affinity service over gRPC, and a real worker-agent process attaches with
the credential the test copies out of the Secret (no kubelet mounts files here).
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import grpc.aio
import pytest
import redis.asyncio as aioredis

from turnstile_affinity.app import create_app
from turnstile_affinity.settings import AffinitySettings
from turnstile_contracts import affinity_pb2, affinity_pb2_grpc
from turnstile_platform.dependencies import DependencyUnavailable
from turnstile_platform.errors import RichError, decode
from turnstile_platform.leader import LeaderElector
from turnstile_platform.redis_client import create_redis
from turnstile_platform.sandbox_credentials import (
    REVOKED,
    CredentialIssuer,
    PresenceClaims,
    SandboxClaims,
    SigningKey,
    VerificationKeys,
    credential_key,
    now_ms,
)
from turnstile_substrate.kubernetes import KubernetesSubstrate, template
from turnstile_substrate.kubernetes.credentials import (
    ANNOTATION_GENERATION,
    COMPONENT,
    LABEL_COMPONENT,
    LABEL_POD,
    activation_generation,
)
from turnstile_substrate.runtime import (
    LABEL_MANAGED_BY,
    LABEL_SANDBOX_ID,
    MANAGED_BY,
    CreateKind,
    Plan,
    RuntimeSpec,
)
from turnstile_testing.kube_emulator import KubeEmulator
from turnstile_testing.kube_emulator.kubelet import mark_running
from turnstile_testing.plugin import CredentialKeyFiles

if TYPE_CHECKING:
    from conftest import StartSubstrate

NS = "sandboxes"


def spec(sandbox: str, generation: int = 1) -> RuntimeSpec:
    return RuntimeSpec(
        sandbox_id=sandbox, tier="default", client_label="acme", generation=generation
    )


async def no_gate() -> None:
    return None


@pytest.fixture
def issuer(
    redis: aioredis.Redis, redis_prefix: str, credential_keys: CredentialKeyFiles
) -> CredentialIssuer:
    signing = SigningKey.from_file(credential_keys.signing_key_file)
    return CredentialIssuer(signing, redis, redis_prefix, ttl_s=3600)


@pytest.fixture
def keys(credential_keys: CredentialKeyFiles) -> VerificationKeys:
    return VerificationKeys(credential_keys.public_keys_file)


def secret_of(kube: KubeEmulator, pod_name: str) -> dict[str, Any] | None:
    return kube.secret(NS, template.credential_secret_name(pod_name))


def credential_in(secret: dict[str, Any] | None) -> str:
    assert secret is not None, "no credential Secret"
    return base64.b64decode(secret["data"][template.CREDENTIAL_KEY]).decode()


async def cold(sub: KubernetesSubstrate, sandbox: str) -> str:
    runtime = await sub.ensure_runtime(spec(sandbox), Plan(CreateKind.COLD), no_gate)
    return runtime.name


async def test_a_cold_pod_mounts_a_secret_holding_its_sandbox_credential_never_inlined(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    issuer: CredentialIssuer,
    keys: VerificationKeys,
    redis: aioredis.Redis,
    redis_prefix: str,
) -> None:
    async with substrate(kube, credentials=issuer) as sub:
        name = await cold(sub, "sb-a")

        secret = secret_of(kube, name)
        credential = credential_in(secret)
        claims = keys.verify(credential, "sb-a")
        assert claims.generation == activation_generation(name, spec("sb-a"))
        assert await redis.get(credential_key(redis_prefix, "sb-a")) == claims.generation.encode()
        assert secret is not None
        assert secret["metadata"]["labels"] == {
            LABEL_MANAGED_BY: MANAGED_BY,
            LABEL_COMPONENT: COMPONENT,
            LABEL_SANDBOX_ID: "sb-a",
            LABEL_POD: name,
        }
        pod = kube.pod(NS, name)
        assert pod is not None
        assert credential not in json.dumps(pod)
        volume = next(v for v in pod["spec"]["volumes"] if v["name"] == "credential")
        assert volume["secret"]["secretName"] == f"{name}-credential"
        assert volume["secret"]["optional"] is True
        container = pod["spec"]["containers"][0]
        assert {"name": "credential", "mountPath": template.CREDENTIAL_DIR, "readOnly": True} in (
            container["volumeMounts"]
        )
        env = {e["name"]: e["value"] for e in container["env"]}
        assert env[template.ENV_CREDENTIAL_FILE] == template.CREDENTIAL_FILE
        assert pod["spec"]["securityContext"]["fsGroup"] == sub.settings.run_as_group

        # A retried create of the same activation keeps the same Secret and generation.
        again = await sub.ensure_runtime(spec("sb-a"), Plan(CreateKind.COLD), no_gate)
        assert again.name == name
        assert credential_in(secret_of(kube, name)) == credential


async def test_without_a_signing_key_pods_mount_no_credential(
    kube: KubeEmulator, substrate: StartSubstrate
) -> None:
    async with substrate(kube) as sub:
        name = await cold(sub, "sb-a")
        pod = kube.pod(NS, name)
        assert pod is not None
        assert [v["name"] for v in pod["spec"]["volumes"]] == ["podinfo", "tmp"]
        assert secret_of(kube, name) is None


async def test_a_warm_claim_writes_a_secret_bound_to_the_pod_uid(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    issuer: CredentialIssuer,
    keys: VerificationKeys,
) -> None:
    async with substrate(
        kube, credentials=issuer, tier_runtimes={"default": {"warm_pool_size": 1}}
    ) as sub:
        await sub.reflector.wait_until(lambda: sub.index.warm_count("default") == 1, 10)
        warm = next(iter(sub.index.warm("default")))
        assert secret_of(kube, warm.name) is None  # nothing until a claim

        plan = sub.plan(spec("sb-w"))
        assert plan.kind is CreateKind.WARM
        runtime = await sub.ensure_runtime(spec("sb-w"), plan, no_gate)

        assert (runtime.kind, runtime.name) == (CreateKind.WARM, warm.name)
        secret = secret_of(kube, warm.name)
        claims = keys.verify(credential_in(secret), "sb-w")
        assert claims.pod_uid == warm.uid
        assert secret is not None
        assert secret["metadata"]["ownerReferences"][0]["uid"] == warm.uid


async def test_a_lost_warm_adoption_removes_the_secret_it_wrote(
    kube: KubeEmulator, substrate: StartSubstrate, issuer: CredentialIssuer
) -> None:
    async with substrate(
        kube, credentials=issuer, tier_runtimes={"default": {"warm_pool_size": 1}}
    ) as sub:
        await sub.reflector.wait_until(lambda: sub.index.warm_count("default") == 1, 10)
        warm = next(iter(sub.index.warm("default")))
        kube.inject_failure(409, method="PATCH", path=rf".*/pods/{warm.name}", reason="Conflict")

        runtime = await sub.ensure_runtime(spec("sb-w"), sub.plan(spec("sb-w")), no_gate)

        assert runtime.name != warm.name  # another warm pod, or a cold create
        assert secret_of(kube, warm.name) is None
        assert secret_of(kube, runtime.name) is not None


async def _wait_for(probe: Callable[[], Awaitable[bool]], timeout_s: float = 30) -> None:
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


@contextlib.asynccontextmanager
async def relay(
    redis_url: str, redis_prefix: str, keys: CredentialKeyFiles
) -> AsyncIterator[tuple[str, affinity_pb2_grpc.AffinityServiceAsyncStub]]:
    values: dict[str, Any] = {
        "redis_url": redis_url,
        "redis_prefix": redis_prefix,
        "port": 0,
        "metrics_port": 0,
        "wake_enabled": False,
        "heartbeat_interval_s": 0.2,
        "presence_ttl_s": 5.0,
        "shutdown_grace_s": 0.2,
        "log_format": "text",
        "worker_attestation": "enforce",
        "worker_credential_public_keys_file": keys.public_keys_file,
    }
    settings = AffinitySettings(**values)
    app = await create_app(settings)
    await app.start()
    address = f"127.0.0.1:{app.port}"
    try:
        async with grpc.aio.insecure_channel(address) as channel:
            yield address, affinity_pb2_grpc.AffinityServiceStub(channel)
    finally:
        await app.stop()


@pytest.mark.timeout(120)
async def test_a_worker_process_attaches_with_its_mounted_credential_and_no_one_else_can(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    issuer: CredentialIssuer,
    credential_keys: CredentialKeyFiles,
    redis_url: str,
    redis_prefix: str,
    tmp_path: Path,
) -> None:
    async with (
        relay(redis_url, redis_prefix, credential_keys) as (address, stub),
        substrate(kube, credentials=issuer) as sub,
    ):
        pod_a = await cold(sub, "sb-a")
        await cold(sub, "sb-b")
        a_credential = credential_in(secret_of(kube, pod_a))
        # What the kubelet would do: project the Secret's key into the mounted directory.
        mounted = tmp_path / "credential"
        mounted.write_text(a_credential)
        environment = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("TURNSTILE_WORKER_", "TURNSTILE_AFFINITY_ADDR"))
        }
        environment.update(
            TURNSTILE_AFFINITY_ADDR=address,
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
                listed = await stub.ListWorkers(affinity_pb2.ListWorkersRequest())
                return "sb-a" in {w.sandbox_id for w in listed.workers}

            await _wait_for(attached)

            refused = await _hello(stub, "sb-b", a_credential)
            assert refused.code is grpc.StatusCode.PERMISSION_DENIED
            assert refused.metadata["why"] == "wrong_sandbox"
        finally:
            proc.kill()
            await proc.wait()

        # Deactivate: the Secret goes and the credential is refused.
        await sub.stop_runtime("sb-a")
        assert secret_of(kube, pod_a) is None
        refused = await _hello(stub, "sb-a", a_credential)
        assert refused.code is grpc.StatusCode.PERMISSION_DENIED


async def test_renewal_replaces_the_secret_before_expiry_and_binds_the_pod_uid(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    issuer: CredentialIssuer,
    keys: VerificationKeys,
    redis: aioredis.Redis,
    redis_prefix: str,
) -> None:
    async with substrate(kube, credentials=issuer) as sub:
        name = await cold(sub, "sb-a")
        await sub.reflector.wait_until(lambda: name in sub.index.pods, 5)
        delivery = sub.credentials
        assert delivery is not None
        first: SandboxClaims = keys.verify(credential_in(secret_of(kube, name)), "sb-a")
        assert first.pod_uid == ""  # a cold pod's uid exists only after its create

        # The first pass binds the uid.
        assert (await delivery.renew_pass()).renewed == 1
        bound = keys.verify(credential_in(secret_of(kube, name)), "sb-a")
        assert bound.pod_uid == sub.index.pods[name].uid
        assert bound.generation == first.generation
        # Nothing is due now...
        assert (await delivery.renew_pass()).renewed == 0
        # ...until past half the ttl.
        later = now_ms() + issuer.ttl_ms * 6 // 10
        assert (await delivery.renew_pass(at_ms=later)).renewed == 1
        renewed = keys.verify(credential_in(secret_of(kube, name)), "sb-a")
        assert renewed.expires_ms >= bound.expires_ms
        assert renewed.generation == first.generation
        assert await redis.get(credential_key(redis_prefix, "sb-a")) == first.generation.encode()

        # A revoked runtime's Secret is not renewed.
        await issuer.revoke("sb-a")
        before = secret_of(kube, name)
        result = await delivery.renew_pass(at_ms=later)
        assert (result.renewed, result.revoked) == (0, 1)
        assert secret_of(kube, name) == before
        assert await redis.get(credential_key(redis_prefix, "sb-a")) == REVOKED.encode()


async def test_the_credential_attests_owner_tier_capacity_and_the_renewal_binds_the_pod_ip(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    issuer: CredentialIssuer,
    keys: VerificationKeys,
) -> None:
    async with substrate(kube, credentials=issuer, worker_capacity=3, worker_port=8080) as sub:
        name = await cold(sub, "sb-a")
        first = keys.verify(credential_in(secret_of(kube, name)), "sb-a").presence
        # SPEC O3: what the substrate started; a cold pod has no IP yet, so no endpoint.
        assert first == PresenceClaims("acme", "default", 3, "")
        kube.mutate_pod(NS, name, mark_running)  # scheduled: it has an IP now
        await sub.reflector.wait_until(lambda: bool(getattr(sub.index.pods.get(name), "ip", "")), 5)
        ip = sub.index.pods[name].ip
        assert (await sub.credentials.renew_pass()).renewed == 1  # type: ignore[union-attr]
        bound = keys.verify(credential_in(secret_of(kube, name)), "sb-a").presence
        assert bound == PresenceClaims("acme", "default", 3, f"{ip}:8080")
        # Bound: nothing is due until half the ttl.
        assert (await sub.credentials.renew_pass()).renewed == 0  # type: ignore[union-attr]


async def test_orphaned_secrets_are_revoked_and_swept_after_the_grace(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    issuer: CredentialIssuer,
    redis: aioredis.Redis,
    redis_prefix: str,
) -> None:
    gone = await issuer.issue("gone", generation="g-gone")
    labels = {
        LABEL_MANAGED_BY: MANAGED_BY,
        LABEL_COMPONENT: COMPONENT,
        LABEL_SANDBOX_ID: "gone",
        LABEL_POD: "ts-gone-abc",
    }
    annotations = {ANNOTATION_GENERATION: gone.generation}
    kube.secrets.create(
        NS,
        {
            "metadata": {
                "name": "ts-gone-abc-credential",
                "labels": labels,
                "annotations": annotations,
            },
            "data": {"credential": "eA=="},
        },
    )
    async with substrate(kube, credentials=issuer, credential_orphan_grace_s=0) as sub:
        live = await cold(sub, "sb-a")
        await sub.reflector.wait_until(lambda: live in sub.index.pods, 5)
        assert sub.credentials is not None

        result = await sub.credentials.renew_pass()

        assert result.swept == 1
        assert kube.secret(NS, "ts-gone-abc-credential") is None
        assert secret_of(kube, live) is not None
        # The live sandbox's credential is untouched; the gone one's is revoked.
        assert (await redis.get(credential_key(redis_prefix, "sb-a"))) not in (None, b"revoked")
        assert await redis.get(credential_key(redis_prefix, "gone")) == REVOKED.encode()

    async with substrate(kube, credentials=issuer) as sub:  # the default grace: 120 s
        kube.secrets.create(
            NS,
            {
                "metadata": {"name": "ts-gone-abc-credential", "labels": labels},
                "data": {"credential": "eA=="},
            },
        )
        assert sub.credentials is not None
        assert (await sub.credentials.renew_pass()).swept == 0  # too young: a create in flight


@contextlib.asynccontextmanager
async def elector(kube: KubeEmulator, identity: str) -> AsyncIterator[LeaderElector]:
    async with kube.api_client() as api:
        yield LeaderElector(
            api,
            namespace=NS,
            lease_name="substrate",
            identity=identity,
            lease_duration_s=3,
            renew_deadline_s=2,
            retry_period_s=0.25,
        )


@pytest.mark.timeout(60)
async def test_only_the_leader_renews(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    issuer: CredentialIssuer,
    keys: VerificationKeys,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        electors = [await stack.enter_async_context(elector(kube, f"r{i}")) for i in range(2)]
        replicas = [
            await stack.enter_async_context(
                substrate(kube, leadership=e, credentials=issuer, credential_renew_interval_s=0.05)
            )
            for e in electors
        ]
        name = await cold(replicas[1], "sb-a")
        tasks = [asyncio.create_task(e.run()) for e in electors]
        try:
            done, _ = await asyncio.wait(
                [asyncio.create_task(e.wait_leading()) for e in electors],
                timeout=30,
                return_when=asyncio.FIRST_COMPLETED,
            )
            assert done
            leader = 0 if electors[0].is_leader else 1
            lead, follow = replicas[leader].credentials, replicas[1 - leader].credentials
            assert lead is not None
            assert follow is not None

            async with asyncio.timeout(30):
                while not keys.verify(credential_in(secret_of(kube, name)), "sb-a").pod_uid:
                    lead.pass_done.clear()
                    await lead.pass_done.wait()

            assert lead.passes >= 1
            assert follow.passes == 0
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_two_replicas_claiming_one_warm_pod_each_get_a_secret_of_their_own(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    issuer: CredentialIssuer,
    keys: VerificationKeys,
) -> None:
    async with contextlib.AsyncExitStack() as stack:
        replicas = [
            await stack.enter_async_context(
                substrate(
                    kube,
                    credentials=issuer,
                    tier_runtimes={"default": {"warm_pool_size": 1}},
                    warm_claim_spread=1,
                )
            )
            for _ in range(2)
        ]
        for replica in replicas:

            def one_warm(r: KubernetesSubstrate = replica) -> bool:
                return r.index.warm_count("default") == 1

            await replica.reflector.wait_until(one_warm, 10)
        # Both claims pass their cap gate only once both have reserved the pod: a real race.
        arrived = 0
        both = asyncio.Event()

        async def gate() -> None:
            nonlocal arrived
            arrived += 1
            if arrived == 2:
                both.set()
            await both.wait()

        runtimes = await asyncio.gather(
            *(
                replica.ensure_runtime(spec(sandbox), Plan(CreateKind.WARM), gate)
                for replica, sandbox in zip(replicas, ("s1", "s2"), strict=True)
            )
        )

        assert runtimes[0].name != runtimes[1].name
        for runtime in runtimes:
            pod = kube.pod(NS, runtime.name)
            assert pod is not None
            assert pod["metadata"]["labels"][LABEL_SANDBOX_ID] == runtime.sandbox_id
            claims = keys.verify(credential_in(secret_of(kube, runtime.name)), runtime.sandbox_id)
            if runtime.kind is CreateKind.WARM:
                assert claims.pod_uid == pod["metadata"]["uid"]


async def test_a_stop_with_redis_unreachable_still_deletes_and_asks_for_a_retry(
    kube: KubeEmulator,
    substrate: StartSubstrate,
    credential_keys: CredentialKeyFiles,
    redis_prefix: str,
) -> None:
    # An issuer on a port nothing listens on: every Redis call fails to connect.
    unreachable = create_redis("redis://127.0.0.1:1/0", timeout_s=1)
    signing = SigningKey.from_file(credential_keys.signing_key_file)
    dead = CredentialIssuer(signing, unreachable, redis_prefix, ttl_s=3600)
    try:
        async with substrate(kube, credentials=dead) as sub:
            with pytest.raises(DependencyUnavailable) as refused:
                await cold(sub, "sb-a")
            assert refused.value.dependency == "redis"  # UNAVAILABLE, by the interceptor
            assert kube.pods(NS) == []  # nothing was made

            kube.secrets.create(
                NS,
                {
                    "metadata": {
                        "name": "ts-sb-a-abc-credential",
                        "labels": {
                            LABEL_MANAGED_BY: MANAGED_BY,
                            LABEL_COMPONENT: COMPONENT,
                            LABEL_SANDBOX_ID: "sb-a",
                            LABEL_POD: "ts-sb-a-abc",
                        },
                    },
                    "data": {"credential": "eA=="},
                },
            )
            with pytest.raises(DependencyUnavailable) as retry:
                await sub.stop_runtime("sb-a")
            assert retry.value.dependency == "redis"
            assert kube.secret(NS, "ts-sb-a-abc-credential") is None
    finally:
        await unreachable.aclose()
