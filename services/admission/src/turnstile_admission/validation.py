"""Request validation: bad input gets INVALID_ARGUMENT naming the field, before
anything touches Redis (SPEC X2)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import NamedTuple

from turnstile_admission.admitter import AdmitInput
from turnstile_admission.decision_log import Query
from turnstile_admission.policies import Kind
from turnstile_clientkeys import (
    Client,
    ClientForm,
    InvalidClientError,
    client_id_problem,
    is_label_value,
    parse_client,
)
from turnstile_contracts import admission_pb2, common_pb2
from turnstile_platform.errors import RichError, bad_field

#: Admit charges a resolved client: inherit is resolved by the substrate first.
ADMIT_FORMS = frozenset({ClientForm.CLIENT_ID, ClientForm.NATIVE, ClientForm.UNATTRIBUTED})
MAX_CANDIDATE_NODES = 256
MAX_NODE_NAME = 253
MAX_HOLD_ID = 64
MAX_WAIT_ID = 64

_KINDS = {
    common_pb2.ACTIVATION_KIND_COLD_CREATE: Kind.COLD_CREATE,
    common_pb2.ACTIVATION_KIND_WARM_CLAIM: Kind.WARM_CLAIM,
    common_pb2.ACTIVATION_KIND_RESUME: Kind.RESUME,
    common_pb2.ACTIVATION_KIND_RESTORE: Kind.RESTORE,
}
_NODE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_HOLD = re.compile(r"[A-Za-z0-9_-]+")

#: How many valid client ids and node names are remembered (below).
MAX_REMEMBERED = 4096
# Whether a client id or a node name is valid depends on nothing but itself, and
# callers send few distinct ones, so the valid ones are remembered instead of
# being validated on every Admit (a client's parsing was the largest share of
# validation: docs/performance.md). Callers choose these strings, so each set
# stops growing at MAX_REMEMBERED: later ones are validated every time.
_clients: dict[str, Client] = {}
_nodes: set[str] = set()


def client(message: common_pb2.ActivationClient, field: str = "client") -> Client:
    if message.WhichOneof("client") == "client_id":
        known = _clients.get(message.client_id)
        if known is not None:
            return known
    try:
        parsed = parse_client(message, allowed=ADMIT_FORMS, field=field)
    except InvalidClientError as error:
        raise bad_field(error.field, error.description) from error
    if parsed.client_id is not None and len(_clients) < MAX_REMEMBERED:
        _clients[parsed.client_id] = parsed
    return parsed


def sandbox_id(value: str, field: str = "sandbox_id") -> str:
    if not value:
        raise bad_field(field, "must not be empty")
    if not is_label_value(value):
        raise bad_field(field, "must be a valid label value of at most 63 characters")
    return value


def hold_id(value: str) -> str:
    if not value:
        raise bad_field("hold_id", "must not be empty")
    if len(value) > MAX_HOLD_ID or not _HOLD.fullmatch(value):
        raise bad_field("hold_id", f"must be 1 to {MAX_HOLD_ID} of [A-Za-z0-9_-]")
    return value


def candidate_nodes(names: Sequence[str]) -> tuple[str, ...]:
    """Candidate node names: at most 256, each a node name, no duplicates."""
    nodes = tuple(names)
    if len(nodes) > MAX_CANDIDATE_NODES:
        raise bad_field("candidate_nodes", f"at most {MAX_CANDIDATE_NODES} names")
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if node not in _nodes:
            if len(node) > MAX_NODE_NAME or not _NODE.fullmatch(node):
                raise bad_field(
                    f"candidate_nodes[{i}]", "must be a node name (1 to 253 characters)"
                )
            if len(_nodes) < MAX_REMEMBERED:
                _nodes.add(node)
        if node in seen:
            raise bad_field(f"candidate_nodes[{i}]", f"duplicate node {node!r}")
        seen.add(node)
    return nodes


def wait_id(value: str, required: bool = False) -> str:
    """A caller's id of a waiting call (AdmitRequest.wait_id): bounded, plain."""
    if not value:
        if required:
            raise bad_field("wait_id", "must not be empty")
        return value
    if len(value) > MAX_WAIT_ID or not _HOLD.fullmatch(value):
        raise bad_field("wait_id", f"must be at most {MAX_WAIT_ID} of A-Z, a-z, 0-9, '-', '_'")
    return value


class WarmRequest(NamedTuple):
    """A validated ReserveWarm request."""

    tier: str
    pod: str
    nodes: tuple[str, ...]


def reserve_warm_request(request: admission_pb2.ReserveWarmRequest) -> WarmRequest:
    if not request.tier or not is_label_value(request.tier):
        raise bad_field("tier", "must be a valid label value")
    return WarmRequest(
        tier=request.tier,
        pod=sandbox_id(request.pod_name, "pod_name"),
        nodes=candidate_nodes(request.candidate_nodes),
    )


def admit_request(request: admission_pb2.AdmitRequest) -> AdmitInput:
    kind = _KINDS.get(request.kind)
    if kind is None:
        raise bad_field("kind", "must be COLD_CREATE, WARM_CLAIM, RESUME or RESTORE")
    if request.tier and not is_label_value(request.tier):
        raise bad_field("tier", "must be empty or a valid label value")
    nodes = candidate_nodes(request.candidate_nodes)
    wait_s = 0.0
    if request.HasField("wait_budget"):
        budget = request.wait_budget
        if budget.seconds < 0 or budget.nanos < 0:
            raise bad_field("wait_budget", "must not be negative")
        wait_s = budget.seconds + budget.nanos / 1e9
    return AdmitInput(
        sandbox_id=sandbox_id(request.sandbox_id),
        client=client(request.client),
        kind=kind,
        tier=request.tier,
        candidate_nodes=nodes,
        wait_s=wait_s,
        queue_per_client=request.queue_per_client,
        dry_run=request.dry_run,
        wait_id=wait_id(request.wait_id),
    )


_ENTRY_ID = re.compile(r"[0-9]{1,20}-[0-9]{1,20}")
#: The clients a decision can be charged to besides a client id.
_RESERVED_CLIENTS = frozenset({"native", "unattributed"})


#: A stream id's parts are unsigned 64-bit numbers (Redis refuses larger ones).
_ID_MAX = 2**64 - 1


def _cursor_problem(name: str, value: str) -> str:
    """Why ``value`` cannot be a ``before``/``after`` cursor ("" when it can): every
    id Redis would refuse in an exclusive range is refused here, before Redis."""
    if not value:
        return ""
    if not _ENTRY_ID.fullmatch(value):
        return "must be an entry id (<ms>-<seq>) from an earlier answer"
    ms, seq = (int(part) for part in value.split("-"))
    if ms > _ID_MAX or seq > _ID_MAX:
        return "must be an entry id (<ms>-<seq>) from an earlier answer: a part is too large"
    if name == "before" and ms == seq == 0:
        return "must be after 0-0: nothing is older"
    if name == "after" and ms == seq == _ID_MAX:
        return "must be before the largest id: nothing is newer"
    return ""


def decisions_query(request: admission_pb2.ListDecisionsRequest, page_limit: int) -> Query:
    """A ListDecisions request as a :class:`~turnstile_admission.decision_log.Query`."""
    client_id = request.client_id
    if client_id and client_id not in _RESERVED_CLIENTS:
        problem = client_id_problem(client_id)
        if problem:
            raise bad_field("client_id", problem)
    if request.sandbox_id:
        sandbox_id(request.sandbox_id)
    if request.limit < 0:
        raise bad_field("limit", "must not be negative")
    for name in ("before", "after"):
        problem = _cursor_problem(name, getattr(request, name))
        if problem:
            raise bad_field(name, problem)
    since_ms = 0
    if request.HasField("since"):
        since_ms = request.since.ToMilliseconds()
        if since_ms < 0:
            raise bad_field("since", "must not be before 1970")
    return Query(
        client=client_id,
        sandbox_id=request.sandbox_id,
        since_ms=since_ms,
        limit=min(request.limit or page_limit, page_limit),
        before=request.before,
        after=request.after,
    )


__all__ = [
    "RichError",
    "admit_request",
    "candidate_nodes",
    "client",
    "decisions_query",
    "hold_id",
    "reserve_warm_request",
    "sandbox_id",
]
