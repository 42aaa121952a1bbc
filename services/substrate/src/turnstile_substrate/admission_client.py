"""The substrate's client of admission: Admit, CommitHold, CancelHold, ReleaseSandbox,
and the cap gate a substrate runs before every runtime it creates.

Admit answers with a decision as data; here a refusal becomes the gRPC error
Activate returns (DESIGN: RESOURCE_EXHAUSTED for limits, UNAVAILABLE when the
policy's store is unreachable and it fails closed), carrying admission's reason,
bounded key, limit and current value in ``ErrorInfo``, its retry hint in
``RetryInfo`` and, for limits, a ``QuotaFailure`` (SPEC P7, X2).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import grpc.aio
from prometheus_client import Counter

from turnstile_clientkeys import Client, to_proto
from turnstile_contracts import admission_pb2, admission_pb2_grpc, common_pb2
from turnstile_platform.errors import QuotaViolation, RichError, decode, reason_name, retry_later
from turnstile_platform.peers import Peer
from turnstile_platform.shared_limits import CLUSTER_BUCKET, NODE_SLOTS, SHARED_LIMIT
from turnstile_substrate.runtime import CapGate, CreateKind

log = logging.getLogger(__name__)

HOLD_OUTCOMES = Counter(
    "turnstile_substrate_admission_holds_total",
    "Admission holds this substrate ended, by how (committed, cancelled, failed).",
    ["outcome"],
)
CAP_GATE_CHECKS = Counter(
    "turnstile_substrate_cap_gate_total",
    "Cap checks run before a runtime was created, by result.",
    ["result"],
)

ACTIVATION_KINDS: dict[CreateKind, common_pb2.ActivationKind.ValueType] = {
    CreateKind.COLD: common_pb2.ACTIVATION_KIND_COLD_CREATE,
    CreateKind.WARM: common_pb2.ACTIVATION_KIND_WARM_CLAIM,
    CreateKind.RESUME: common_pb2.ACTIVATION_KIND_RESUME,
    CreateKind.RESTORE: common_pb2.ACTIVATION_KIND_RESTORE,
}

#: Which ErrorInfo reason a refusal by each policy carries.
REFUSAL_REASONS: dict[admission_pb2.Policy.ValueType, common_pb2.ErrorReason.ValueType] = {
    admission_pb2.POLICY_CAP: common_pb2.ERROR_REASON_CAP_EXCEEDED,
    admission_pb2.POLICY_RATE: common_pb2.ERROR_REASON_RATE_LIMITED,
    admission_pb2.POLICY_CONCURRENCY: common_pb2.ERROR_REASON_CONCURRENCY_LIMITED,
    admission_pb2.POLICY_NODE_SLOTS: common_pb2.ERROR_REASON_NODE_SLOTS_EXHAUSTED,
}


@dataclass(frozen=True)
class Admitted:
    """An admitted activation: its hold, and what the cap gate needs later."""

    hold_id: str
    key: common_pb2.BoundedKey
    node: str
    #: The cap policy's verdict in this decision, if admission reported one.
    cap: admission_pb2.PolicyVerdict | None
    #: How long admission's fair queue made the call wait (None: it did not).
    waited_s: float | None = None
    #: Its position among its key's waiters when it joined (0: it did not).
    queue_position: int = 0
    #: The wait estimated when it joined (None: it did not, or no estimate).
    estimated_wait_s: float | None = None


@dataclass(frozen=True)
class WarmHold:
    """A warm pod's reservation: commit it once the pod exists, cancel it if not."""

    hold_id: str
    node: str


class WarmRefusedError(Exception):
    """Admission keeps the cluster bucket or the nodes' slots for activations now."""

    def __init__(self, refused_by: str, retry_after_s: float, message: str) -> None:
        super().__init__(message)
        #: ``queue``, ``cluster_bucket`` or ``node_slots``.
        self.refused_by = refused_by
        self.retry_after_s = retry_after_s


def _admission_unavailable(retry_after_s: float, reason: str) -> RichError:
    """UNAVAILABLE because admission could not answer (its own reason kept, when it
    gave one); retrying may succeed. A peer's error passed on, not a failing
    Redis or PostgreSQL (the platform interceptor answers those)."""
    return RichError(
        code=grpc.StatusCode.UNAVAILABLE,
        message="admission is unavailable; retry",
        reason=reason or reason_name(common_pb2.ERROR_REASON_DEPENDENCY_UNAVAILABLE),
        metadata={"dependency": "admission"},
        retry_after_s=retry_after_s,
    )


def refusal_error(response: admission_pb2.AdmitResponse, default_retry_s: float) -> RichError:
    """The Activate error for a refused Admit (SPEC P7, X2).

    A refusal whose refusing policy's verdict is UNKNOWN is a fail-closed policy
    whose store could not be reached: UNAVAILABLE with POLICY_BACKEND_UNAVAILABLE.
    Every other refusal is a limit: RESOURCE_EXHAUSTED with a QuotaFailure.
    """
    policy = response.refused_by
    policy_name = admission_pb2.Policy.Name(policy).removeprefix("POLICY_").lower()
    verdict = next((v for v in response.verdicts if v.policy == policy), None)
    retry = (
        response.retry_after.ToTimedelta().total_seconds()
        if response.HasField("retry_after")
        else default_retry_s
    )
    metadata = {
        "key": response.key.key,
        "key_set_version": str(response.key.key_set_version),
        "policy": policy_name,
        "limit": str(response.limit),
        "current": str(response.current),
    }
    shared = _shared_limit(policy, verdict)
    if shared:
        metadata[SHARED_LIMIT] = shared
    summary = response.message or f"refused by the {policy_name} policy"
    if verdict is not None and verdict.verdict == admission_pb2.VERDICT_UNKNOWN:
        return retry_later(
            common_pb2.ERROR_REASON_POLICY_BACKEND_UNAVAILABLE, summary, retry, **metadata
        )
    reason = REFUSAL_REASONS.get(policy, common_pb2.ERROR_REASON_UNSPECIFIED)
    return RichError(
        code=grpc.StatusCode.RESOURCE_EXHAUSTED,
        message=summary,
        reason=reason_name(reason),
        metadata=metadata,
        retry_after_s=retry,
        quota_violations=(
            QuotaViolation(
                subject=response.key.key,
                description=(
                    f"{policy_name}: current {response.current} of limit {response.limit}"
                ),
            ),
        ),
    )


def _shared_limit(
    policy: admission_pb2.Policy.ValueType, verdict: admission_pb2.PolicyVerdict | None
) -> str:
    """The shared limit that refused (SPEC N5: hidden from scoped callers by the
    handler, ``shared_limits.for_caller``), or "" for the key's own, or for a
    fail-closed policy that could not count (UNKNOWN: no number to hide)."""
    if verdict is None or verdict.verdict != admission_pb2.VERDICT_REFUSE:
        return ""
    if policy == admission_pb2.POLICY_NODE_SLOTS:
        return NODE_SLOTS
    if policy == admission_pb2.POLICY_RATE and verdict.detail == CLUSTER_BUCKET:
        return CLUSTER_BUCKET
    return ""


class AdmissionClient:
    """Calls the admission service for the activation orchestration."""

    def __init__(
        self,
        peer: Peer[admission_pb2_grpc.AdmissionServiceAsyncStub],
        *,
        retry_after_s: float,
        timeout_s: float,
    ) -> None:
        """``timeout_s`` is each call's deadline, set on the call itself (see
        :func:`turnstile_platform.peers.admission`)."""
        self._peer = peer
        self._timeout_s = timeout_s
        # The peer's channel is grpc.aio: its stub's calls are awaitable.
        self._stub = peer.stub
        self._retry_after_s = retry_after_s

    async def close(self) -> None:
        await self._peer.close()

    async def admit(
        self,
        sandbox_id: str,
        client: Client,
        kind: CreateKind,
        tier: str,
        candidate_nodes: Sequence[str],
        wait_s: float = 0.0,
        *,
        queue_per_client: bool = False,
        dry_run: bool = False,
        wait_id: str = "",
    ) -> Admitted:
        """Admit the activation or raise its refusal as a :class:`RichError`.

        Admit is not retried here: a retry after a lost answer would take a
        second hold. An answer lost in transit leaves a hold that expires on its
        own (its owner, this call, is gone).

        ``wait_s`` > 0 asks admission to queue the call that long when only a
        shared resource refuses (SPEC Q1), or with ``queue_per_client`` when only
        the client's own limits do; the call's deadline grows by it. ``wait_id``
        names the wait, so the caller can ask GetQueuePosition where it stands.
        """
        request = admission_pb2.AdmitRequest(
            sandbox_id=sandbox_id,
            client=to_proto(client),
            kind=ACTIVATION_KINDS[kind],
            tier=tier,
            candidate_nodes=list(candidate_nodes),
            dry_run=dry_run,
        )
        timeout = self._timeout_s
        if wait_s > 0:
            request.wait_budget.FromMilliseconds(round(wait_s * 1000))
            request.queue_per_client = queue_per_client
            request.wait_id = wait_id
            timeout += wait_s
        try:
            response = await self._stub.Admit(request, timeout=timeout)
        except grpc.aio.AioRpcError as error:
            raise self._peer_error(error) from error
        if response.decision != admission_pb2.DECISION_ADMITTED:
            raise refusal_error(response, self._retry_after_s)
        cap = next((v for v in response.verdicts if v.policy == admission_pb2.POLICY_CAP), None)
        waited = response.waited.ToMilliseconds() / 1000 if response.HasField("waited") else None
        estimate = (
            response.estimated_wait.ToMilliseconds() / 1000
            if response.HasField("estimated_wait")
            else None
        )
        return Admitted(
            hold_id=response.hold_id,
            key=response.key,
            node=response.node,
            cap=cap,
            waited_s=waited,
            queue_position=response.queue_position,
            estimated_wait_s=estimate,
        )

    async def commit(self, hold_id: str, *, creation_prepaid: bool = False) -> None:
        """Commit the hold of an activation that succeeded (or of a warm pod made);
        ``creation_prepaid``: the runtime is a warm pod ReserveWarm paid for, so the
        hold's cluster-bucket token goes back (SPEC W3).

        A failure is logged, never raised: the runtime exists and is recorded,
        and an uncommitted hold only expires on its own.
        """
        try:
            await self._stub.CommitHold(
                admission_pb2.CommitHoldRequest(hold_id=hold_id, creation_prepaid=creation_prepaid),
                timeout=self._timeout_s,
            )
            HOLD_OUTCOMES.labels("committed").inc()
        except grpc.aio.AioRpcError as error:
            HOLD_OUTCOMES.labels("commit_failed").inc()
            log.warning(
                "CommitHold failed; the hold will expire on its own",
                extra={"hold_id": hold_id, "code": error.code().name},
            )

    async def cancel(self, hold_id: str) -> None:
        """Cancel the hold of an activation that failed (best effort, logged)."""
        try:
            await self._stub.CancelHold(
                admission_pb2.CancelHoldRequest(hold_id=hold_id), timeout=self._timeout_s
            )
            HOLD_OUTCOMES.labels("cancelled").inc()
        except grpc.aio.AioRpcError as error:
            HOLD_OUTCOMES.labels("cancel_failed").inc()
            log.warning(
                "CancelHold failed; the hold will expire on its own",
                extra={"hold_id": hold_id, "code": error.code().name},
            )

    async def release_sandbox(self, sandbox_id: str) -> None:
        """Free what the stopped sandbox holds in admission (its node slot)."""
        try:
            await self._stub.ReleaseSandbox(
                admission_pb2.ReleaseSandboxRequest(sandbox_id=sandbox_id), timeout=self._timeout_s
            )
        except grpc.aio.AioRpcError as error:
            raise self._peer_error(error) from error

    async def reserve_warm(self, tier: str, pod_name: str, nodes: Sequence[str]) -> WarmHold:
        """Reserve one warm pod's creation (a cluster token, a node slot) for the
        warm-pool refill (SPEC W3); :class:`WarmRefusedError` when admission keeps
        them for activations, a :class:`RichError` when it cannot be asked.

        Not retried: a retry after a lost answer would take a second hold (the
        first expires on its own)."""
        request = admission_pb2.ReserveWarmRequest(
            tier=tier, pod_name=pod_name, candidate_nodes=list(nodes)
        )
        try:
            response = await self._stub.ReserveWarm(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            rich = decode(error)
            if rich.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
                raise WarmRefusedError(
                    rich.metadata.get("refused_by", rich.reason.lower()),
                    rich.retry_after_s or self._retry_after_s,
                    rich.message,
                ) from error
            raise self._peer_error(error) from error
        return WarmHold(response.hold_id, response.node)

    def cap_gate(self, admitted: Admitted, client: Client) -> CapGate:
        """The check a substrate runs before each runtime it creates (SPEC S5, P1).

        Admit already ran the cap once, before the create branched; the gate
        runs it again right before a pod (or process) is made, for the case
        where more are made than planned (a lost warm claim falls back to a
        cold create, a retry after a failed create). It is a cap-only check
        against admission's own state, through ``GetUsage``: this activation's
        pending entry is already counted, so it refuses when live + pending
        exceeds the cap, with the same CAP_EXCEEDED error an Admit refusal gives.

        It asks nothing when Admit's cap verdict says the cap cannot refuse:
        not enforced (off, shadow) or unknown (the live count is unsupported, as
        on Direct, with pending below the cap: admission admits, SPEC S4). After a
        PASS, a usage without a live count means the count is *unavailable* (timed out, failed, not
        current): zero is its lower bound, so the gate decides on the pending set
        alone, the same rule Admit applies, rather than letting the pod through.
        If admission cannot be reached it fails closed (UNAVAILABLE): no pod is
        created unchecked.
        """
        cap = admitted.cap

        async def gate() -> None:
            if (
                cap is None
                or cap.mode != admission_pb2.POLICY_MODE_ENFORCE
                or cap.verdict != admission_pb2.VERDICT_PASS
            ):
                CAP_GATE_CHECKS.labels("skipped").inc()
                return
            try:
                usage = await self._stub.GetUsage(
                    admission_pb2.GetUsageRequest(client=to_proto(client)), timeout=self._timeout_s
                )
            except grpc.aio.AioRpcError as error:
                CAP_GATE_CHECKS.labels("unavailable").inc()
                raise self._peer_error(error) from error
            counted = usage.HasField("live")
            live = usage.live if counted else 0
            current = live + usage.pending
            if current <= usage.cap:
                CAP_GATE_CHECKS.labels("pass" if counted else "pass_pending_alone").inc()
                return
            CAP_GATE_CHECKS.labels("refused" if counted else "refused_pending_alone").inc()
            live_text = f"{live} live" if counted else "live count unavailable"
            raise RichError(
                code=grpc.StatusCode.RESOURCE_EXHAUSTED,
                message=(
                    f"cap of {usage.cap} reached for key {usage.key.key!r} "
                    f"({live_text} + {usage.pending} pending, this activation included); "
                    "frees when one of its sandboxes stops"
                ),
                reason=reason_name(common_pb2.ERROR_REASON_CAP_EXCEEDED),
                metadata={
                    "key": usage.key.key,
                    "key_set_version": str(usage.key.key_set_version),
                    "policy": "cap",
                    "limit": str(usage.cap),
                    "current": str(current - 1),
                },
                retry_after_s=self._retry_after_s,
                quota_violations=(
                    QuotaViolation(
                        subject=usage.key.key,
                        description=f"cap: current {current - 1} of limit {usage.cap}",
                    ),
                ),
            )

        return gate

    def _peer_error(self, error: grpc.aio.AioRpcError) -> RichError:
        """An admission RPC failure as Activate's error.

        Admission's own rich errors keep their reason (e.g. a fail-closed
        POLICY_BACKEND_UNAVAILABLE); transport failures become UNAVAILABLE
        DEPENDENCY_UNAVAILABLE. Either way the caller may retry.
        """
        rich = decode(error)
        if rich.code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return _admission_unavailable(rich.retry_after_s or self._retry_after_s, rich.reason)
        if rich.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
            return rich
        return RichError(
            code=grpc.StatusCode.INTERNAL if rich.code != grpc.StatusCode.CANCELLED else rich.code,
            message=f"admission answered {rich.code.name}: {rich.message}",
            reason=rich.reason,
            metadata=dict(rich.metadata),
        )
