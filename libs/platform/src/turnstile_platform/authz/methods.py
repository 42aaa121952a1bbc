"""For each method that acts for a client, where that client comes from — in one place.

The policy (:mod:`turnstile_platform.authz.policy`) says which clients an
identity may act for; this table says which clients a call acts for (all of them
must be allowed). A sandbox's owner is its recorded client; an id ``<client>--…``
lies in that client's namespace (:mod:`turnstile_platform.authz.ownership`, SPEC O1):

==============================  ===============================================================
``GetUsage``,                   the request's ``client``: a client id, or the reserved keys
``GetQueuePosition``            ``native`` / ``unattributed`` (a wait is found by client and
                                wait id together, so another client's is not found)
``Activate``                    the request's ``client`` *and* the sandbox's owner (with none
                                recorded: its namespace's client), so a ``self``- or
                                list-scoped identity can neither take over nor restore another
                                tenant's sandbox, nor create an id outside its namespace;
                                ``inherit`` acts for the recorded client alone
``Admit``                       the request's ``client`` and the sandbox id's namespace
                                client: admission keeps no owner record
``Deactivate``, ``GetSandbox``  the sandbox's recorded client (substrate record)
``ReleaseSandbox`` (admission)  the sandbox's recorded client; admission keeps no owner
                                record, so only an identity allowed ``any`` client may call it
``ListSandboxes``               the request's ``client_id``; empty (every client) needs ``any``
``ListDecisions`` (admission)   the request's ``client_id``; empty (every client's decisions)
                                needs ``any``; the handler returns that client's entries alone
``Place``, ``GetSession``,      the request's ``client_id``: the client the session belongs to
``Prepare``                     (SPEC O2, W2)
``ReleaseLease``,               the request's ``client_id``; empty (whoever the lease was placed
``ListWorkers``                 for, every client's sandboxes) needs ``any``
``AdminService`` (admission),   the platform's: limits and the key set apply to every client,
every method                    so only an identity allowed ``any`` may call them (SPEC M1),
                                whatever a policy grants a scoped one
==============================  ===============================================================

Every other method (holds, warm-pool reservations, the relay, counting) acts for no
client: the method grant alone decides. A sandbox-addressed call whose owner is unknown
(no such sandbox, no recorded client, or a service without an owner lookup)
acts for no client and is allowed only to an identity with ``any`` — except that
an id in the caller's own namespace may be activated (created) by it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from turnstile_contracts import (
    admission_pb2,
    affinity_pb2,
    common_pb2,
    substrate_pb2,
)
from turnstile_platform.authz.ownership import client_why, namespace_of, sandbox_why
from turnstile_platform.authz.policy import AuthzDecision

#: Resolves a sandbox id to its recorded client id (None: unknown).
OwnerLookup = Callable[[str], Awaitable[str | None]]


@dataclass(frozen=True)
class FromRequest:
    """The client is named in the request (None: the request names none)."""

    client: Callable[[Any], str | None]


@dataclass(frozen=True)
class FromSandbox:
    """The client is the recorded owner of the sandbox the request names."""

    sandbox_id: Callable[[Any], str]


@dataclass(frozen=True)
class FromActivationClient:
    """``client`` in the request, with ``inherit`` meaning the sandbox's owner; a
    client named explicitly acts for the sandbox's owner too (None: the request
    names no sandbox)."""

    client: Callable[[Any], common_pb2.ActivationClient]
    sandbox_id: Callable[[Any], str] | None


@dataclass(frozen=True)
class PlatformWide:
    """The call changes or reads what applies to every client (the admin API): it
    acts for all of them, so only an identity allowed ``any`` client may make it."""


ClientSource = FromRequest | FromSandbox | FromActivationClient | PlatformWide

INHERIT = object()


def activation_client(client: common_pb2.ActivationClient) -> str | object | None:
    """The client id an ``ActivationClient`` names, :data:`INHERIT`, or None (unset)."""
    form = client.WhichOneof("client")
    if form == "client_id":
        return client.client_id
    if form == "native":
        return "native"
    if form == "unattributed":
        return "unattributed"
    if form == "inherit":
        return INHERIT
    return None


def _name(descriptor: Any, service: str, method: str) -> str:
    full: str = descriptor.services_by_name[service].full_name
    return f"/{full}/{method}"


_ADMISSION = admission_pb2.DESCRIPTOR
_SUBSTRATE = substrate_pb2.DESCRIPTOR
_AFFINITY = affinity_pb2.DESCRIPTOR

CLIENT_SOURCES: dict[str, ClientSource] = {
    _name(_ADMISSION, "AdmissionService", "Admit"): FromActivationClient(
        lambda r: r.client, lambda r: r.sandbox_id
    ),
    _name(_ADMISSION, "AdmissionService", "GetUsage"): FromActivationClient(
        lambda r: r.client, None
    ),
    _name(_ADMISSION, "AdmissionService", "GetQueuePosition"): FromActivationClient(
        lambda r: r.client, None
    ),
    _name(_ADMISSION, "AdmissionService", "ReleaseSandbox"): FromSandbox(lambda r: r.sandbox_id),
    _name(_ADMISSION, "AdmissionService", "ListDecisions"): FromRequest(
        lambda r: r.client_id or None
    ),
    **{
        _name(_ADMISSION, "AdminService", method.name): PlatformWide()
        for method in _ADMISSION.services_by_name["AdminService"].methods
    },
    _name(_SUBSTRATE, "SubstrateService", "Activate"): FromActivationClient(
        lambda r: r.client, lambda r: r.sandbox_id
    ),
    _name(_SUBSTRATE, "SubstrateService", "Deactivate"): FromSandbox(lambda r: r.sandbox_id),
    _name(_SUBSTRATE, "SubstrateService", "GetSandbox"): FromSandbox(lambda r: r.sandbox_id),
    _name(_SUBSTRATE, "SubstrateService", "ListSandboxes"): FromRequest(
        lambda r: r.client_id or None
    ),
    _name(_AFFINITY, "AffinityService", "Place"): FromRequest(lambda r: r.client_id or None),
    _name(_AFFINITY, "AffinityService", "GetSession"): FromRequest(lambda r: r.client_id or None),
    _name(_AFFINITY, "AffinityService", "Prepare"): FromRequest(lambda r: r.client_id or None),
    _name(_AFFINITY, "AffinityService", "ReleaseLease"): FromRequest(lambda r: r.client_id or None),
    _name(_AFFINITY, "AffinityService", "ListWorkers"): FromRequest(lambda r: r.client_id or None),
}


def all_methods() -> frozenset[str]:
    """Every RPC of Turnstile's contracts as ``pkg.Service/Method`` (policy validation)."""
    out: set[str] = set()
    for descriptor in (admission_pb2.DESCRIPTOR, substrate_pb2.DESCRIPTOR, affinity_pb2.DESCRIPTOR):
        for service in descriptor.services_by_name.values():
            out |= {f"{service.full_name}/{m.name}" for m in service.methods}
    return frozenset(out)


async def refusal(
    source: ClientSource, request: Any, decision: AuthzDecision, owner: OwnerLookup | None
) -> str | None:
    """Why the call acts for a client ``decision`` does not allow, or None if it may
    go on. A refusal about a sandbox never says whether, or to whom, it is recorded.

    An explicit-client call on an id in the caller's own namespace needs no owner
    lookup here: the handler checks the record it reads (``ownership.current_scope``)."""
    allows = decision.allows_client
    if isinstance(source, PlatformWide):
        return None if decision.any_client else "only an identity allowed any client may call this"
    if isinstance(source, FromRequest):
        client = source.client(request)
        return None if allows(client) else client_why(client)
    if isinstance(source, FromSandbox):
        sandbox_id = source.sandbox_id(request)
        recorded = await owner(sandbox_id) if owner is not None else None
        return None if allows(recorded) else sandbox_why(sandbox_id)
    named = activation_client(source.client(request))
    sandbox_id = source.sandbox_id(request) if source.sandbox_id is not None else ""
    if named is INHERIT:
        if not sandbox_id:
            return client_why(None)
        recorded = await owner(sandbox_id) if owner is not None else None
        return None if allows(recorded) else sandbox_why(sandbox_id)
    client = named if isinstance(named, str) else None
    if not allows(client):
        return client_why(client)
    if source.sandbox_id is None or allows(namespace_of(sandbox_id)):
        return None
    recorded = await owner(sandbox_id) if owner is not None else None
    return None if allows(recorded) else sandbox_why(sandbox_id)
