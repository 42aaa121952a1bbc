"""Between the contract and the domain: request validation and response building.

Validation collects every bad field of a request, so one INVALID_ARGUMENT names
them all (SPEC X2), and runs before anything is read or changed.
"""

from __future__ import annotations

import base64
import binascii
import re
from datetime import UTC, datetime

import grpc
from google.protobuf import timestamp_pb2

from turnstile_clientkeys import (
    MAX_LABEL_VALUE_LENGTH,
    Client,
    ClientForm,
    InvalidClientError,
    client_id_problem,
    is_label_value,
    parse_client,
)
from turnstile_contracts import common_pb2, substrate_pb2
from turnstile_platform.errors import (
    FieldViolation,
    RichError,
    bad_field,
    invalid_argument,
    reason_name,
)
from turnstile_platform.tiers import TierConfig, UnknownTierError
from turnstile_substrate.activation import Activation, Outcome, SandboxView
from turnstile_substrate.db.records import SandboxRecord
from turnstile_substrate.runtime import CountUnknown, LiveCount, Runtime

#: Client forms Activate accepts: ``unattributed`` is what inherit resolves to,
#: never something a caller may send.
ACTIVATE_CLIENT_FORMS = (ClientForm.CLIENT_ID, ClientForm.INHERIT, ClientForm.NATIVE)

MAX_PENDING_IDS = 10_000
DEFAULT_PAGE_SIZE = 100
MAX_PAGE_SIZE = 1000

OUTCOMES = {
    Outcome.ALREADY_RUNNING: substrate_pb2.OUTCOME_ALREADY_RUNNING,
    Outcome.CREATED: substrate_pb2.OUTCOME_CREATED,
    Outcome.WARM_CLAIMED: substrate_pb2.OUTCOME_WARM_CLAIMED,
    Outcome.RESTORED: substrate_pb2.OUTCOME_RESTORED,
    Outcome.RESUMED: substrate_pb2.OUTCOME_RESUMED,
}
STATES = {
    "running": substrate_pb2.SANDBOX_STATE_RUNNING,
    "stopped": substrate_pb2.SANDBOX_STATE_STOPPED,
}
UNKNOWN_REASONS = {
    "unsupported": substrate_pb2.UNKNOWN_REASON_UNSUPPORTED,
    "not_synced": substrate_pb2.UNKNOWN_REASON_NOT_SYNCED,
}


class Violations:
    """Collects field violations; :meth:`check` raises them all at once."""

    def __init__(self) -> None:
        self.items: list[FieldViolation] = []

    def add(self, field: str, description: str) -> None:
        self.items.append(FieldViolation(field, description))

    def label_value(self, field: str, value: str, *, required: bool = True) -> None:
        if not value:
            if required:
                self.add(field, "must not be empty")
            return
        if len(value) > MAX_LABEL_VALUE_LENGTH:
            self.add(field, f"must be at most {MAX_LABEL_VALUE_LENGTH} characters")
        elif not is_label_value(value):
            self.add(
                field,
                "must be a Kubernetes label value: letters, digits, '-', '_' or '.', "
                "beginning and ending with a letter or digit",
            )

    def check(self) -> None:
        if self.items:
            raise invalid_argument(*self.items)


# -- requests ----------------------------------------------------------------


def activate_request(
    request: substrate_pb2.ActivateRequest, tiers: TierConfig
) -> tuple[str, Client, str]:
    """``(sandbox_id, client, tier)`` of a valid ActivateRequest; an empty tier is the
    default tier, so records, pod labels and workers always name a declared one."""
    violations = Violations()
    violations.label_value("sandbox_id", request.sandbox_id)
    client: Client | None = None
    try:
        client = parse_client(request.client, allowed=ACTIVATE_CLIENT_FORMS)
    except InvalidClientError as error:
        violations.add(error.field, error.description)
    # Checked even when the sandbox exists (its tier stays its record's): a tier
    # that is not a label value or not declared is the caller's mistake either way.
    violations.label_value("tier", request.tier, required=False)
    tier = request.tier
    if not violations.items or violations.items[-1].field != "tier":
        try:
            tier = tiers.session_tier(request.tier)
        except UnknownTierError as error:
            violations.add("tier", str(error))
    violations.check()
    assert client is not None
    return request.sandbox_id, client, tier


def sandbox_id(value: str) -> str:
    """A valid ``sandbox_id`` field."""
    violations = Violations()
    violations.label_value("sandbox_id", value)
    violations.check()
    return value


def count_request(
    request: substrate_pb2.CountLiveSandboxesRequest,
) -> tuple[str, str | None, tuple[str, ...]]:
    """``(key, exclude_sandbox_id, pending)`` of a valid CountLiveSandboxesRequest."""
    violations = Violations()
    violations.label_value("key", request.key)
    violations.label_value("exclude_sandbox_id", request.exclude_sandbox_id, required=False)
    pending = tuple(request.pending_sandbox_ids)
    if len(pending) > MAX_PENDING_IDS:
        violations.add("pending_sandbox_ids", f"must hold at most {MAX_PENDING_IDS} ids")
    else:
        for index, pending_id in enumerate(pending):
            if not is_label_value(pending_id):
                violations.label_value(f"pending_sandbox_ids[{index}]", pending_id)
                break
    violations.check()
    return request.key, request.exclude_sandbox_id or None, pending


def list_request(
    request: substrate_pb2.ListSandboxesRequest,
) -> tuple[int, tuple[datetime, str] | None, str | None]:
    """``(page_size, after, client_id)`` of a valid ListSandboxesRequest."""
    violations = Violations()
    page_size = request.page_size or DEFAULT_PAGE_SIZE
    if not 1 <= page_size <= MAX_PAGE_SIZE:
        violations.add("page_size", f"must be 0 (default {DEFAULT_PAGE_SIZE}) to {MAX_PAGE_SIZE}")
    after = None
    if request.page_token:
        try:
            after = decode_page_token(request.page_token)
        except ValueError:
            violations.add("page_token", "is not a token from a previous response")
    problem = client_id_problem(request.client_id) if request.client_id else None
    if problem is not None:
        violations.add("client_id", problem)
    violations.check()
    return page_size, after, request.client_id or None


def encode_page_token(record: SandboxRecord) -> str:
    """A cursor after ``record`` in newest-first order."""
    micros = int(record.created_at.timestamp() * 1_000_000)
    raw = f"{micros}:{record.id}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_page_token(token: str) -> tuple[datetime, str]:
    try:
        raw = base64.urlsafe_b64decode(token + "=" * (-len(token) % 4)).decode()
        micros, sep, last_id = raw.partition(":")
        if not sep or not last_id:
            raise ValueError("malformed page token")
        created = datetime.fromtimestamp(int(micros) / 1_000_000, tz=UTC)
    except (binascii.Error, UnicodeDecodeError, OverflowError, OSError) as error:
        raise ValueError("malformed page token") from error
    return created, last_id


# -- responses ---------------------------------------------------------------


def _timestamp(value: datetime) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value)
    return stamp


def sandbox(
    record: SandboxRecord | None,
    runtime: Runtime | None,
    substrate_name: str,
    *,
    live: bool = False,
) -> substrate_pb2.Sandbox:
    """The contract's Sandbox from a record and, when one runs, its runtime.

    With ``live`` the runtime was looked up, and state and runtime fields say
    what runs now: the record may be behind (a process that died, a pod deleted
    by hand), and a recorded runtime that no longer runs shows as stopped.
    Without it (ListSandboxes) they are the record's.
    """
    message = substrate_pb2.Sandbox(substrate=record.substrate if record else substrate_name)
    if record is not None:
        message.sandbox_id = record.id
        message.tier = record.tier
        message.state = STATES[record.state]
        message.created_at.CopyFrom(_timestamp(record.created_at))
        message.updated_at.CopyFrom(_timestamp(record.updated_at))
        if record.activating_client_id is not None:
            message.activating_client_id = record.activating_client_id
        if live and runtime is None:
            message.state = substrate_pb2.SANDBOX_STATE_STOPPED
        if record.execution is not None and record.state == "running" and not live:
            message.runtime_name = record.execution.runtime_name
            message.node = record.execution.node
            message.endpoint = record.execution.endpoint
    if runtime is not None:
        message.sandbox_id = runtime.sandbox_id
        message.state = substrate_pb2.SANDBOX_STATE_RUNNING
        message.runtime_name = runtime.name
        message.node = runtime.node
        message.endpoint = runtime.endpoint
        if record is None:
            message.tier = runtime.tier
            if runtime.client_label is not None:
                message.activating_client_id = runtime.client_label
    return message


def sandbox_view(found: SandboxView, substrate_name: str) -> substrate_pb2.Sandbox:
    """GetSandbox's Sandbox: the record, corrected by what runs now."""
    return sandbox(found.record, found.runtime, substrate_name, live=True)


#: A caller's id of a waiting call (ActivateRequest.wait_id), as admission takes it.
MAX_WAIT_ID = 64
_WAIT_ID = re.compile(r"[A-Za-z0-9_-]+")


def wait_id(value: str) -> str:
    """The call's wait id, checked here so a bad one changes nothing (not even a
    claim) before admission would refuse it."""
    if value and (len(value) > MAX_WAIT_ID or not _WAIT_ID.fullmatch(value)):
        raise bad_field("wait_id", f"must be at most {MAX_WAIT_ID} of A-Z, a-z, 0-9, '-', '_'")
    return value


def wait_budget(
    request: substrate_pb2.ActivateRequest, remaining_s: float | None, create_margin_s: float
) -> float:
    """How long admission may queue this Activate (SPEC Q1): its ``wait_budget``,
    bounded by the call's remaining deadline less what the create needs; 0 when
    it asks not to wait or has no time to."""
    if not request.HasField("wait_budget"):
        return 0.0
    budget = request.wait_budget
    if budget.seconds < 0 or budget.nanos < 0:
        raise bad_field("wait_budget", "must not be negative")
    wait_s = budget.seconds + budget.nanos / 1e9
    if remaining_s is not None:
        wait_s = min(wait_s, remaining_s - create_margin_s)
    return max(0.0, wait_s)


def activate_response(
    activation: Activation, substrate_name: str, sandbox_id: str = "", tier: str = ""
) -> substrate_pb2.ActivateResponse:
    response = substrate_pb2.ActivateResponse(
        sandbox=sandbox(activation.record, activation.runtime, substrate_name),
        outcome=OUTCOMES[activation.outcome],
        dry_run=activation.dry_run,
    )
    if activation.runtime is None and activation.record is None:
        # A dry run of a sandbox that does not exist yet: as the request names it.
        response.sandbox.sandbox_id = sandbox_id
        response.sandbox.tier = tier
    charged = (
        activation.runtime.client_label
        if activation.runtime is not None
        else activation.would_charge
    )
    if activation.record is not None:
        charged = activation.record.activating_client_id
    if charged is not None:
        response.charged_client_id = charged
    if activation.key is not None:
        response.key.CopyFrom(activation.key)
    if activation.waited_s is not None:
        response.waited.FromMilliseconds(round(activation.waited_s * 1000))
    if activation.queue_position:
        response.queue_position = activation.queue_position
    if activation.estimated_wait_s is not None:
        response.estimated_wait.FromMilliseconds(round(activation.estimated_wait_s * 1000))
    return response


def count_response(
    count: LiveCount | CountUnknown, key_set_version: int
) -> substrate_pb2.CountLiveSandboxesResponse:
    response = substrate_pb2.CountLiveSandboxesResponse(key_set_version=key_set_version)
    if isinstance(count, CountUnknown):
        response.unknown.reason = UNKNOWN_REASONS.get(
            count.reason, substrate_pb2.UNKNOWN_REASON_UNSPECIFIED
        )
        response.unknown.detail = count.detail
    else:
        response.known.live = count.live
        response.known.live_pending_sandbox_ids.extend(sorted(count.live_pending))
    return response


def not_found(sandbox_id: str) -> RichError:
    return RichError(
        code=grpc.StatusCode.NOT_FOUND,
        message=f"no sandbox {sandbox_id!r}",
        reason=reason_name(common_pb2.ERROR_REASON_NOT_FOUND),
        metadata={"sandbox_id": sandbox_id},
    )
