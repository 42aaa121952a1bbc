"""Activate and Deactivate on the Direct substrate, end to end over gRPC: real
processes, real PostgreSQL, a stand-in admission service on a real socket."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from typing import TYPE_CHECKING

import grpc
import redis.asyncio as aioredis
from google.protobuf.duration_pb2 import Duration

from turnstile_contracts import admission_pb2, common_pb2, substrate_pb2
from turnstile_platform.sandbox_credentials import VerificationKeys, credential_key
from turnstile_substrate.direct import processes
from turnstile_testing.plugin import CredentialKeyFiles
from turnstile_testing.processes import RedisProcess

if TYPE_CHECKING:
    from conftest import Harness, StartService


def pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except FileNotFoundError:
        return False


def environment(pid: int) -> list[bytes]:
    with open(f"/proc/{pid}/environ", "rb") as environ:
        return environ.read().split(b"\0")


async def test_a_sandbox_activated_without_a_tier_runs_in_the_default_tier(
    migrated_url: str, start_service: StartService
) -> None:
    harness = await start_service(migrated_url, tiers="container,microvm")
    response = await harness.activate("sb-1", "acme")
    assert response.sandbox.tier == "container"
    [row] = await harness.rows("SELECT tier FROM sandboxes")
    assert row["tier"] == "container"
    # The worker is labelled with it: an unlabelled worker is excluded from placement.
    assert b"TURNSTILE_WORKER_TIER=container" in environment(harness.processes()["sb-1"])


async def test_activate_starts_a_real_process_and_records_its_attribution(
    harness: Harness,
) -> None:
    response = await harness.activate("sb-1", "acme", tier="gpu")

    assert response.outcome == substrate_pb2.OUTCOME_CREATED
    assert response.charged_client_id == "acme"
    assert response.key.key == "acme"
    assert response.sandbox.state == substrate_pb2.SANDBOX_STATE_RUNNING
    assert response.sandbox.tier == "gpu"
    assert response.sandbox.substrate == "direct"
    pids = harness.processes()
    assert list(pids) == ["sb-1"]
    assert response.sandbox.runtime_name == f"proc-{pids['sb-1']}"
    environ = environment(pids["sb-1"])
    assert b"TURNSTILE_WORKER_SANDBOX_ID=sb-1" in environ
    assert b"TURNSTILE_WORKER_TIER=gpu" in environ
    assert not any(v.startswith(b"TURNSTILE_DATABASE_URL=") for v in environ)

    [row] = await harness.rows("SELECT state, activating_client_id, tier FROM sandboxes")
    assert dict(row) == {"state": "running", "activating_client_id": "acme", "tier": "gpu"}
    [execution] = await harness.rows(
        "SELECT runtime_name, client_label, charged_key, ended_at FROM executions"
    )
    assert execution["runtime_name"] == response.sandbox.runtime_name
    assert execution["client_label"] == "acme"
    assert execution["charged_key"] == "acme"
    assert execution["ended_at"] is None
    [receipt] = await harness.rows("SELECT kind, client_id, runtime_name FROM receipts")
    assert dict(receipt) == {
        "kind": "start",
        "client_id": "acme",
        "runtime_name": response.sandbox.runtime_name,
    }
    [hold] = harness.admission.holds.values()
    assert hold.state == "committed"


async def test_an_already_running_sandbox_answers_without_asking_admission(
    harness: Harness,
) -> None:
    first = await harness.activate("sb-1", "acme")
    harness.admission.cap = 0  # admission would refuse anything now

    again = await harness.activate("sb-1", "globex")

    assert again.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING
    assert again.sandbox.runtime_name == first.sandbox.runtime_name
    assert again.charged_client_id == "acme"  # the runtime's creator stays charged
    assert not again.HasField("key")
    assert len(harness.admission.admits) == 1
    assert len(harness.processes()) == 1


async def test_deactivate_stops_the_process_ends_the_execution_and_frees_the_slot(
    harness: Harness,
) -> None:
    await harness.activate("sb-1", "acme")
    pid = harness.processes()["sb-1"]

    response = await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))

    assert response.stopped
    assert not pid_alive(pid)
    assert harness.processes() == {}
    [row] = await harness.rows("SELECT state, activating_client_id FROM sandboxes")
    assert dict(row) == {"state": "stopped", "activating_client_id": "acme"}
    [execution] = await harness.rows("SELECT ended_at, end_reason FROM executions")
    assert execution["ended_at"] is not None
    assert execution["end_reason"] == "deactivated"
    assert harness.admission.released == ["sb-1"]

    again = await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))
    assert not again.stopped


async def test_activating_a_stopped_sandbox_restores_it_and_writes_a_restore_receipt(
    harness: Harness,
) -> None:
    await harness.activate("sb-1", "acme", tier="gpu")
    workspace = harness.state_dir / "sb-1" / "workspace"
    (workspace / "notes.txt").write_text("kept")
    await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))

    response = await harness.activate("sb-1", harness.inherit(), tier="ignored")

    assert response.outcome == substrate_pb2.OUTCOME_RESTORED
    assert response.sandbox.tier == "gpu"  # an existing sandbox keeps its tier
    assert response.charged_client_id == "acme"
    assert (workspace / "notes.txt").read_text() == "kept"
    assert harness.admission.admits[-1].kind == common_pb2.ACTIVATION_KIND_RESTORE
    receipts = await harness.rows("SELECT kind, client_id FROM receipts ORDER BY id")
    assert [dict(r) for r in receipts] == [
        {"kind": "start", "client_id": "acme"},
        {"kind": "restore", "client_id": "acme"},
    ]
    executions = await harness.rows("SELECT ended_at IS NULL AS active FROM executions")
    assert sorted(r["active"] for r in executions) == [False, True]


async def test_a_runtime_whose_process_died_is_not_running_and_is_started_again(
    harness: Harness,
) -> None:
    await harness.activate("sb-1", "acme")
    pid = harness.processes()["sb-1"]
    ticks = processes.start_ticks(pid)
    assert ticks is not None
    os.killpg(pid, signal.SIGKILL)
    assert await processes.wait_exit(pid, ticks, timeout_s=5)

    found = await harness.stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id="sb-1"))
    assert found.sandbox.state == substrate_pb2.SANDBOX_STATE_STOPPED
    assert found.sandbox.runtime_name == ""

    response = await harness.activate("sb-1", harness.inherit())
    assert response.outcome == substrate_pb2.OUTCOME_RESTORED
    assert harness.processes()["sb-1"] != pid
    active = await harness.rows("SELECT id FROM executions WHERE ended_at IS NULL")
    assert len(active) == 1


async def test_counts_are_unknown_on_direct(harness: Harness) -> None:
    await harness.activate("sb-1", "acme")

    response = await harness.stub.CountLiveSandboxes(
        substrate_pb2.CountLiveSandboxesRequest(key="acme", pending_sandbox_ids=["sb-1"])
    )

    assert response.WhichOneof("result") == "unknown"
    assert response.unknown.reason == substrate_pb2.UNKNOWN_REASON_UNSUPPORTED


async def test_a_refusal_is_resource_exhausted_with_admissions_reason_and_creates_nothing(
    harness: Harness,
) -> None:
    harness.admission.cap = 1
    await harness.activate("sb-1", "acme")

    error = await harness.error(harness.activate("sb-2", "acme"))

    assert error.code == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert error.reason == "CAP_EXCEEDED"
    assert error.metadata["key"] == "acme"
    assert error.metadata["limit"] == "1"
    assert error.metadata["current"] == "1"
    assert error.retry_after_s == 2.0
    assert [v.subject for v in error.quota_violations] == ["acme"]
    assert list(harness.processes()) == ["sb-1"]
    assert [r["id"] for r in await harness.rows("SELECT id FROM sandboxes")] == ["sb-1"]


async def test_a_fail_closed_policy_refusal_is_unavailable_and_retryable(
    harness: Harness,
) -> None:
    harness.admission.answer = admission_pb2.AdmitResponse(
        decision=admission_pb2.DECISION_REFUSED,
        refused_by=admission_pb2.POLICY_RATE,
        verdicts=[
            admission_pb2.PolicyVerdict(
                policy=admission_pb2.POLICY_RATE,
                mode=admission_pb2.POLICY_MODE_ENFORCE,
                verdict=admission_pb2.VERDICT_UNKNOWN,
                detail="redis unreachable",
            )
        ],
    )

    error = await harness.error(harness.activate("sb-1", "acme"))

    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason == "POLICY_BACKEND_UNAVAILABLE"
    assert error.retry_after_s == harness.settings.retry_after_s
    assert harness.processes() == {}
    assert await harness.rows("SELECT id FROM sandboxes") == []


async def test_a_runtime_that_cannot_start_cancels_the_hold_and_leaves_no_row(
    start_service: StartService, migrated_url: str
) -> None:
    harness = await start_service(
        migrated_url, direct_runtime_command="/nonexistent/turnstile-worker"
    )

    error = await harness.error(harness.activate("sb-1", "acme"))

    assert error.code == grpc.StatusCode.UNAVAILABLE
    assert error.reason == "RUNTIME_FAILED"
    assert error.retryable
    assert [h.state for h in harness.admission.holds.values()] == ["cancelled"]
    assert await harness.rows("SELECT id FROM sandboxes") == []
    assert harness.processes() == {}


async def test_activate_mints_the_leader_renews_and_deactivate_revokes_the_credential(
    migrated_url: str,
    start_service: StartService,
    credential_keys: CredentialKeyFiles,
    redis: aioredis.Redis,
    redis_url: str,
    redis_prefix: str,
) -> None:
    harness = await start_service(
        migrated_url,
        redis_url=redis_url,
        worker_credential_signing_key_file=credential_keys.signing_key_file,
        worker_credential_renew_interval_s=0.05,
    )
    keys = VerificationKeys(credential_keys.public_keys_file)
    await harness.activate("sb-1", "acme")
    path = harness.state_dir / "sb-1" / "credential"
    first = keys.verify(path.read_text(), "sb-1")
    assert f"TURNSTILE_WORKER_CREDENTIAL_FILE={path}".encode() in environment(
        harness.processes()["sb-1"]
    )
    record = credential_key(redis_prefix, "sb-1")
    assert await redis.get(record) == first.generation.encode()

    # Past half its ttl: the renewal pass (leader work, on the process's local
    # leadership) re-mints it for the same runtime.
    aged = time.time() - 1900
    os.utime(path, (aged, aged))
    async with asyncio.timeout(15):
        while True:
            if path.stat().st_mtime != aged:
                break
            await asyncio.sleep(0.05)
    renewed = keys.verify(path.read_text(), "sb-1")
    assert renewed.generation == first.generation
    assert renewed.expires_ms > first.expires_ms

    await harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))
    assert await redis.get(record) == b"revoked"
    assert not path.exists()


async def test_with_redis_unreachable_activate_starts_nothing_and_deactivate_still_stops(
    migrated_url: str,
    start_service: StartService,
    credential_keys: CredentialKeyFiles,
    private_redis: RedisProcess,
) -> None:
    harness = await start_service(
        migrated_url,
        redis_url=private_redis.url,
        redis_timeout_s=0.2,
        worker_credential_signing_key_file=credential_keys.signing_key_file,
    )
    await harness.activate("sb-1", "acme")
    pid = harness.processes()["sb-1"]
    private_redis.stop()

    # No credential can be recorded: nothing is started, and the caller may retry.
    refused = await harness.error(harness.activate("sb-2", "acme"))
    assert (refused.code, refused.reason) == (
        grpc.StatusCode.UNAVAILABLE,
        "DEPENDENCY_UNAVAILABLE",
    )
    assert refused.metadata["dependency"] == "redis"
    assert "sb-2" not in harness.processes()

    # No revocation can be written: the runtime is stopped all the same, and the
    # Deactivate answers UNAVAILABLE so that it is retried.
    stopped = await harness.error(
        harness.stub.Deactivate(substrate_pb2.DeactivateRequest(sandbox_id="sb-1"))
    )
    assert stopped.code == grpc.StatusCode.UNAVAILABLE
    assert not pid_alive(pid)


async def test_a_wait_budget_reaches_admission_bounded_by_the_deadline(
    migrated_url: str, start_service: StartService
) -> None:
    """Activate passes its wait budget down to Admit (SPEC Q1), less what the
    create needs from the caller's remaining deadline."""
    harness = await start_service(migrated_url, admission_wait_margin_s=2.0)
    request = substrate_pb2.ActivateRequest(
        sandbox_id="sb-1",
        client=common_pb2.ActivationClient(client_id="acme"),
        wait_budget=Duration(seconds=30),
    )
    response = await harness.stub.Activate(request, timeout=10)
    assert response.outcome == substrate_pb2.OUTCOME_CREATED
    [admit] = harness.admission.admits
    budget = admit.wait_budget.ToMilliseconds() / 1000
    assert 7.0 < budget <= 8.0  # 10 s deadline less the 2 s margin, not 30 s
    assert not admit.queue_per_client
    # Without a budget, admission is asked to answer at once.
    await harness.activate("sb-2", "acme")
    assert not harness.admission.admits[1].HasField("wait_budget")


async def test_queue_per_client_reaches_admission_with_the_budget(
    migrated_url: str, start_service: StartService
) -> None:
    """SPEC Q1: an Activate that asks to wait for its client's own limits too
    asks admission so; without a budget there is nothing to wait with."""
    harness = await start_service(migrated_url)
    for sandbox_id, budget in (("sb-1", Duration(seconds=5)), ("sb-2", None)):
        request = substrate_pb2.ActivateRequest(
            sandbox_id=sandbox_id,
            client=common_pb2.ActivationClient(client_id="acme"),
            wait_budget=budget,
            queue_per_client=True,
        )
        await harness.stub.Activate(request, timeout=30)
    assert [a.queue_per_client for a in harness.admission.admits] == [True, False]


async def test_a_wait_id_reaches_admission_and_a_bad_one_changes_nothing(
    migrated_url: str, start_service: StartService
) -> None:
    """SPEC Q1: the caller's wait_id goes down to Admit, so GetQueuePosition finds
    the call while it waits; a bad one is INVALID_ARGUMENT before anything is asked."""
    harness = await start_service(migrated_url)
    request = substrate_pb2.ActivateRequest(
        sandbox_id="sb-1",
        client=common_pb2.ActivationClient(client_id="acme"),
        wait_budget=Duration(seconds=5),
        wait_id="w-1",
    )
    await harness.stub.Activate(request, timeout=30)
    assert [a.wait_id for a in harness.admission.admits] == ["w-1"]
    request.sandbox_id, request.wait_id = "sb-2", "not/a wait"
    refused = await harness.error(harness.stub.Activate(request, timeout=30))
    assert refused.code == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.field_violations[0].field == "wait_id"
    assert len(harness.admission.admits) == 1


async def test_an_activate_that_waited_says_how_long(
    migrated_url: str, start_service: StartService
) -> None:
    harness = await start_service(migrated_url)
    answer = admission_pb2.AdmitResponse(
        decision=admission_pb2.DECISION_ADMITTED,
        hold_id="h-waited",
        key=common_pb2.BoundedKey(key="acme", kind=common_pb2.KEY_KIND_OWN, key_set_version=1),
        waited=Duration(nanos=250_000_000),
        queue_position=4,
        estimated_wait=Duration(nanos=300_000_000),
    )
    harness.admission.answer = answer
    request = substrate_pb2.ActivateRequest(
        sandbox_id="sb-1",
        client=common_pb2.ActivationClient(client_id="acme"),
        wait_budget=Duration(seconds=5),
    )
    response = await harness.stub.Activate(request, timeout=30)
    assert response.waited.ToMilliseconds() == 250
    assert response.queue_position == 4
    assert response.estimated_wait.ToMilliseconds() == 300
