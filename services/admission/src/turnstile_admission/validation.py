"""Request validation: bad input gets INVALID_ARGUMENT naming the field, before
anything touches Redis (SPEC X2)."""

from __future__ import annotations

import re

from turnstile_admission.admitter import AdmitInput
from turnstile_admission.policies import Kind
from turnstile_clientkeys import (
    Client,
    ClientForm,
    InvalidClientError,
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

_KINDS = {
    common_pb2.ACTIVATION_KIND_COLD_CREATE: Kind.COLD_CREATE,
    common_pb2.ACTIVATION_KIND_WARM_CLAIM: Kind.WARM_CLAIM,
    common_pb2.ACTIVATION_KIND_RESUME: Kind.RESUME,
    common_pb2.ACTIVATION_KIND_RESTORE: Kind.RESTORE,
}
_NODE = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?")
_HOLD = re.compile(r"[A-Za-z0-9_-]+")


def client(message: common_pb2.ActivationClient, field: str = "client") -> Client:
    try:
        return parse_client(message, allowed=ADMIT_FORMS, field=field)
    except InvalidClientError as error:
        raise bad_field(error.field, error.description) from error


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


def admit_request(request: admission_pb2.AdmitRequest) -> AdmitInput:
    kind = _KINDS.get(request.kind)
    if kind is None:
        raise bad_field("kind", "must be COLD_CREATE, WARM_CLAIM, RESUME or RESTORE")
    if request.tier and not is_label_value(request.tier):
        raise bad_field("tier", "must be empty or a valid label value")
    nodes = tuple(request.candidate_nodes)
    if len(nodes) > MAX_CANDIDATE_NODES:
        raise bad_field("candidate_nodes", f"at most {MAX_CANDIDATE_NODES} names")
    seen: set[str] = set()
    for i, node in enumerate(nodes):
        if len(node) > MAX_NODE_NAME or not _NODE.fullmatch(node):
            raise bad_field(f"candidate_nodes[{i}]", "must be a node name (1 to 253 characters)")
        if node in seen:
            raise bad_field(f"candidate_nodes[{i}]", f"duplicate node {node!r}")
        seen.add(node)
    return AdmitInput(
        sandbox_id=sandbox_id(request.sandbox_id),
        client=client(request.client),
        kind=kind,
        tier=request.tier,
        candidate_nodes=nodes,
    )


__all__ = ["RichError", "admit_request", "client", "hold_id", "sandbox_id"]
