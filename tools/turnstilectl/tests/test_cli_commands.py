"""Commands against small gRPC servers of the test's own (real sockets): what a
person sees, what a script reads, and which exit code each answer gets."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import grpc
import grpc.aio
import pytest
from google.protobuf import duration_pb2, timestamp_pb2

from turnstile_cli.cli import run
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    affinity_pb2,
    affinity_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.errors import QuotaViolation, RichError, abort, bad_field

Context = grpc.aio.ServicerContext[Any, Any]


class Substrate(substrate_pb2_grpc.SubstrateServiceServicer):
    """Refuses ``limited-*`` (rate), answers ``busy-*`` as unavailable, creates the rest."""

    async def Activate(
        self, request: substrate_pb2.ActivateRequest, context: Context
    ) -> substrate_pb2.ActivateResponse:
        if request.sandbox_id.startswith("limited"):
            await abort(
                context,
                RichError(
                    code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                    message="refused by rate for key acme: 0 of 2 (client bucket)",
                    reason="RATE_LIMITED",
                    metadata={"key": "acme", "policy": "rate", "limit": "2", "current": "0"},
                    retry_after_s=1.2,
                    quota_violations=(QuotaViolation("acme", "rate: current 0 of limit 2"),),
                ),
            )
        if request.sandbox_id.startswith("down"):
            await abort(
                context,
                RichError(
                    code=grpc.StatusCode.UNAVAILABLE,
                    message="admission is unavailable; retry",
                    reason="DEPENDENCY_UNAVAILABLE",
                    retry_after_s=1.0,
                ),
            )
        if request.sandbox_id.startswith("bad"):
            await abort(context, bad_field("sandbox_id", "must be a label value"))
        if request.sandbox_id.startswith("wait"):  # echoes the wait budget as the wait
            return substrate_pb2.ActivateResponse(
                sandbox=substrate_pb2.Sandbox(
                    # and queue_per_client as the tier
                    sandbox_id=request.sandbox_id,
                    tier="per-client" if request.queue_per_client else "",
                ),
                outcome=substrate_pb2.OUTCOME_CREATED,
                waited=request.wait_budget if request.HasField("wait_budget") else None,
                queue_position=2 if request.HasField("wait_budget") else 0,
                estimated_wait=duration_pb2.Duration(nanos=400_000_000)
                if request.HasField("wait_budget")
                else None,
            )
        if request.sandbox_id.startswith("form"):  # says which client form arrived
            return substrate_pb2.ActivateResponse(
                sandbox=substrate_pb2.Sandbox(sandbox_id=request.sandbox_id),
                charged_client_id=str(request.client.WhichOneof("client")),
            )
        return substrate_pb2.ActivateResponse(
            sandbox=substrate_pb2.Sandbox(
                sandbox_id=request.sandbox_id, tier=request.tier, runtime_name="proc-1"
            ),
            outcome=substrate_pb2.OUTCOME_CREATED,
            charged_client_id=request.client.client_id,
            key=common_pb2.BoundedKey(
                key=request.client.client_id, kind=common_pb2.KEY_KIND_OWN, key_set_version=3
            ),
        )


class Affinity(affinity_pb2_grpc.AffinityServiceServicer):
    """Moves ``moved-*`` sessions with a workspace reset; ``pending-*`` wait."""

    released: list[str]

    def __init__(self) -> None:
        self.released = []
        self.traces: list[str] = []
        self.clients: list[str] = []

    def _trace(self, context: Context) -> None:
        """The trace id the call came with (W3C ``traceparent``: version-trace-span-flags)."""
        for key, value in context.invocation_metadata() or ():
            if key == "traceparent":
                self.traces.append(str(value).split("-")[1])

    async def Place(
        self, request: affinity_pb2.PlaceRequest, context: Context
    ) -> affinity_pb2.PlaceResponse:
        self._trace(context)
        self.clients.append(request.client_id)
        if request.session_id.startswith("pending"):
            await abort(
                context,
                RichError(
                    code=grpc.StatusCode.UNAVAILABLE,
                    message="sandbox sb-1 is away",
                    reason="SANDBOX_PENDING",
                    metadata={"sandbox_id": "sb-1"},
                    retry_after_s=3,
                ),
            )
        response = affinity_pb2.PlaceResponse(
            sandbox_id="sb-2",
            tier="microvm",
            lease_id="lease-1",
            outcome=affinity_pb2.PLACEMENT_OUTCOME_HIT,
        )
        if request.session_id.startswith("moved"):
            response.outcome = affinity_pb2.PLACEMENT_OUTCOME_FALLBACK
            response.reset.CopyFrom(
                affinity_pb2.WorkspaceReset(
                    from_sandbox_id="sb-1",
                    to_sandbox_id="sb-2",
                    at=timestamp_pb2.Timestamp(seconds=1_800_000_000),
                    reason=affinity_pb2.RESET_REASON_GRACE_EXPIRED,
                )
            )
        return response

    async def ReleaseLease(
        self, request: affinity_pb2.ReleaseLeaseRequest, context: Context
    ) -> affinity_pb2.ReleaseLeaseResponse:
        self._trace(context)
        self.released.append(request.lease_id)
        return affinity_pb2.ReleaseLeaseResponse(released=True)

    async def Prepare(
        self, request: affinity_pb2.PrepareRequest, context: Context
    ) -> affinity_pb2.PrepareResponse:
        """``away-*`` starts a wake, ``gone-*`` is no session, the rest run."""
        self.clients.append(request.client_id)
        if request.session_id.startswith("gone"):
            return affinity_pb2.PrepareResponse(outcome=affinity_pb2.PREPARE_OUTCOME_NO_SESSION)
        if request.session_id.startswith("away"):
            return affinity_pb2.PrepareResponse(
                outcome=affinity_pb2.PREPARE_OUTCOME_WAKE_STARTED,
                sandbox_id="sb-1",
                remaining_grace=duration_pb2.Duration(seconds=42),
            )
        return affinity_pb2.PrepareResponse(
            outcome=affinity_pb2.PREPARE_OUTCOME_RUNNING, sandbox_id="sb-2"
        )


class Admission(admission_pb2_grpc.AdmissionServiceServicer):
    async def CommitHold(
        self, request: admission_pb2.CommitHoldRequest, context: Context
    ) -> admission_pb2.CommitHoldResponse:
        return admission_pb2.CommitHoldResponse(committed=request.hold_id == "h-open")

    async def Admit(
        self, request: admission_pb2.AdmitRequest, context: Context
    ) -> admission_pb2.AdmitResponse:
        if request.HasField("wait_budget"):  # as if it had waited its whole budget
            return admission_pb2.AdmitResponse(
                decision=admission_pb2.DECISION_REFUSED,
                key=common_pb2.BoundedKey(key="acme", kind=common_pb2.KEY_KIND_OWN),
                refused_by=admission_pb2.POLICY_RATE,
                retry_after=duration_pb2.Duration(nanos=20_000_000),
                message="refused by rate; waited in the fair queue"
                + ("; for the client's own limits too" if request.queue_per_client else ""),
                waited=request.wait_budget,
                queue_position=3,
                estimated_wait=duration_pb2.Duration(nanos=600_000_000),
            )
        return admission_pb2.AdmitResponse(
            retry_after=duration_pb2.Duration(seconds=1, nanos=250_000_000),
            message="refused by concurrency",
            decision=admission_pb2.DECISION_REFUSED,
            key=common_pb2.BoundedKey(key="shared", kind=common_pb2.KEY_KIND_SHARED),
            refused_by=admission_pb2.POLICY_CONCURRENCY,
            limit=2,
            current=2,
            verdicts=[
                admission_pb2.PolicyVerdict(
                    policy=admission_pb2.POLICY_CONCURRENCY,
                    mode=admission_pb2.POLICY_MODE_ENFORCE,
                    verdict=admission_pb2.VERDICT_REFUSE,
                    limit=2,
                    current=2,
                )
            ],
        )

    async def GetUsage(
        self, request: admission_pb2.GetUsageRequest, context: Context
    ) -> admission_pb2.GetUsageResponse:
        return admission_pb2.GetUsageResponse(
            key=common_pb2.BoundedKey(key=request.client.client_id, kind=common_pb2.KEY_KIND_OWN),
            pending=2,
            cap=20,
            client_tokens=1.5,
            client_capacity=2,
            cluster_tokens=100,
            cluster_capacity=200,
            in_flight=1,
            concurrency_limit=10,
        )


@pytest.fixture
async def servers() -> AsyncIterator[tuple[dict[str, str], Affinity]]:
    server = grpc.aio.server()
    # Partial servers: only the RPCs the CLI calls here are implemented.
    affinity = Affinity()  # type: ignore[abstract]
    substrate_pb2_grpc.add_SubstrateServiceServicer_to_server(Substrate(), server)  # type: ignore[abstract]
    affinity_pb2_grpc.add_AffinityServiceServicer_to_server(affinity, server)
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(Admission(), server)  # type: ignore[abstract]
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    address = f"127.0.0.1:{port}"
    try:
        yield {"admission": address, "substrate": address, "affinity": address}, affinity
    finally:
        await server.stop(None)


async def _cli(
    capsys: pytest.CaptureFixture[str], targets: dict[str, str], *argv: str
) -> tuple[int, str]:
    """Exit code and stdout (the answer); :func:`_cli_err` also returns stderr."""
    code, out, _ = await _cli_err(capsys, targets, *argv)
    return code, out


async def _cli_err(
    capsys: pytest.CaptureFixture[str], targets: dict[str, str], *argv: str
) -> tuple[int, str, str]:
    flags = [f"--{name}={address}" for name, address in targets.items()]
    code = await asyncio.to_thread(run, [*flags, "--color", "never", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


async def test_a_rate_refusal_shows_reason_limit_current_and_retry_and_exits_3(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await _cli_err(capsys, servers[0], "activate", "limited-1", "--client", "acme")
    assert code == 3
    assert out == ""  # errors and refusals go to stderr: stdout holds only answers
    for text in ("RATE_LIMITED", "limit", "2", "current", "0", "retry in 2 s", "acme"):
        assert text in err


async def test_json_errors_carry_the_decoded_details_for_scripts(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = await _cli(capsys, servers[0], "activate", "limited-1", "--client", "a", "--json")
    error = json.loads(out)["error"]
    assert code == 3
    assert error["reason"] == "RATE_LIMITED"
    assert error["retry_after_s"] == pytest.approx(1.2)
    assert error["metadata"]["limit"] == "2"


@pytest.mark.parametrize("form", ["inherit", "native"])
async def test_activate_sends_every_client_form_through_the_typed_client(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str], form: str
) -> None:
    """``activate`` calls through turnstile_client (its activate takes any form)."""
    code, out = await _cli(capsys, servers[0], "activate", "form-1", f"--{form}", "--json")
    assert code == 0, out
    assert json.loads(out)["charged_client_id"] == form


async def test_admit_wait_shows_the_wait_position_and_estimate(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = await _cli(capsys, servers[0], "admit", "sb-1", "--client", "acme", "--wait", "2s")
    assert code == 3, out
    assert "2.000s in the fair queue" in out
    assert "3 when it joined, estimated 0.600s" in out


@pytest.mark.parametrize(
    ("command", "sandbox", "sent"),
    [
        # The stand-ins say it arrived: admission in its message, substrate as the tier.
        ("admit", "sb-1", "for the client's own limits too"),
        ("activate", "wait-q", "per-client"),
    ],
)
async def test_queue_per_client_is_sent_with_the_wait_budget(
    servers: tuple[dict[str, str], Affinity],
    capsys: pytest.CaptureFixture[str],
    command: str,
    sandbox: str,
    sent: str,
) -> None:
    args = (command, sandbox, "--client", "acme", "--json")
    _, out = await _cli(capsys, servers[0], *args, "--wait", "1s", "--queue-per-client")
    assert sent in out
    _, out = await _cli(capsys, servers[0], *args, "--wait", "1s")
    assert sent not in out
    code, _ = await _cli(capsys, servers[0], *args, "--queue-per-client")
    assert code == 2  # a usage error: nothing to wait with


async def test_activate_wait_sends_the_budget_and_shows_the_wait(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = await _cli(
        capsys, servers[0], "activate", "wait-1", "--client", "a", "--wait", "1500ms"
    )
    assert code == 0, out
    assert "waited" in out
    assert "1.500s" in out
    assert "2 when it joined, estimated 0.400s" in out
    code, out = await _cli(capsys, servers[0], "activate", "wait-2", "--client", "a", "--json")
    assert "waited" not in json.loads(out)
    with pytest.raises(SystemExit) as usage:
        await _cli(capsys, servers[0], "activate", "wait-3", "--client", "a", "--wait", "soon")
    assert usage.value.code == 2


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["activate", "sb-1", "--client", "acme"], 0),
        (["activate", "down-1", "--client", "acme"], 4),
        (["activate", "bad-1", "--client", "acme"], 2),
        (["place", "pending-1", "--client", "acme"], 4),
        (["admit", "sb-1", "--client", "acme"], 3),
        (["usage", "--client", "acme"], 0),
    ],
)
async def test_exit_codes_tell_refused_from_retryable_from_invalid(
    servers: tuple[dict[str, str], Affinity],
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    expected: int,
) -> None:
    code, _ = await _cli(capsys, servers[0], *argv)
    assert code == expected


async def test_an_unreachable_service_is_retryable_with_a_hint(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, _, err = await _cli_err(
        capsys, {"affinity": "127.0.0.1:1"}, "place", "s1", "--client", "acme", "--timeout", "2"
    )
    assert code == 4
    assert "turnstilectl status" in err


async def test_a_workspace_reset_is_the_first_thing_printed(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = await _cli(
        capsys, servers[0], "place", "moved-1", "--client", "acme", "--tier", "microvm"
    )
    assert code == 0
    first = out.lstrip().splitlines()[0]
    assert first.startswith("WARNING")
    warning = out[: out.index("✓")]
    assert "from sb-1 to sb-2" in " ".join(warning.split())
    assert "(fallback)" in out


async def test_place_without_reset_prints_no_warning_and_release_returns_the_lease(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    targets, affinity = servers
    code, out = await _cli(
        capsys, targets, "place", "s-1", "--client", "acme", "--release", "--json"
    )
    assert code == 0
    answer = json.loads(out)
    assert answer["lease_released"] is True
    assert "reset" not in answer
    assert affinity.released == ["lease-1"]
    assert affinity.clients[-1] == "acme"  # the session's client (SPEC O2)
    # One command, one trace: Place and ReleaseLease both carry the printed trace id.
    assert affinity.traces[-2:] == [answer["trace_id"]] * 2


async def test_prepare_says_what_it_did_and_a_missing_session_exits_1(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    targets, affinity = servers
    code, out = await _cli(capsys, targets, "prepare", "away-1", "--client", "acme")
    assert code == 0
    assert "wake started" in out
    assert "sb-1" in out
    assert "42.0 s" in out
    assert affinity.clients[-1] == "acme"
    code, out = await _cli(capsys, targets, "prepare", "chat", "--client", "acme", "--json")
    assert (code, json.loads(out)["outcome"]) == (0, "PREPARE_OUTCOME_RUNNING")
    code, _, err = await _cli_err(capsys, targets, "prepare", "gone-1", "--client", "acme")
    assert code == 1
    assert "no session gone-1 of client acme" in err


async def test_trace_prints_the_commands_trace_id_on_stderr(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    targets, affinity = servers
    code, _, err = await _cli_err(
        capsys, targets, "place", "s-2", "--client", "acme", "--release", "--trace"
    )
    assert code == 0
    assert f"trace {affinity.traces[-1]}" in err


async def test_an_invalid_argument_names_its_field_once(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await _cli_err(capsys, servers[0], "activate", "bad-1", "--client", "acme")
    assert code == 2
    assert out == ""
    assert err.count("must be a label value") == 1


async def test_per_command_target_overrides_the_global_address(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    real = servers[0]["substrate"]
    code, _ = await _cli(
        capsys,
        {"substrate": "127.0.0.1:1"},
        "activate",
        "sb-1",
        "--client",
        "acme",
        "--target",
        real,
    )
    assert code == 0


def test_a_command_without_its_client_is_a_usage_error() -> None:
    with pytest.raises(SystemExit) as raised:
        run(["activate", "sb-1"])
    assert raised.value.code == 2


async def test_a_refused_admit_in_json_carries_error_retry_after_s_as_a_number(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out = await _cli(capsys, servers[0], "admit", "sb-1", "--client", "acme", "--json")
    answer = json.loads(out)
    assert code == 3
    assert answer["error"]["retry_after_s"] == pytest.approx(1.25)
    assert answer["error"]["reason"] == "CONCURRENCY_LIMITED"


async def test_settling_an_unknown_hold_exits_1_on_stderr(
    servers: tuple[dict[str, str], Affinity], capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = await _cli_err(capsys, servers[0], "hold", "commit", "h-unknown")
    assert code == 1
    assert out == ""
    assert "h-unknown" in err
    code, _, _ = await _cli_err(capsys, servers[0], "hold", "commit", "h-open")
    assert code == 0
