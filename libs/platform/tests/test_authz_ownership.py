"""Whom a call acts for, with sandbox ownership (SPEC O1): id namespaces, the owner
lookup only where it is needed, and refusals that never say whose a sandbox is."""

from __future__ import annotations

from typing import Any

import pytest

from turnstile_contracts import admission_pb2, common_pb2, substrate_pb2
from turnstile_platform.authz.authorizer import Authorizer
from turnstile_platform.authz.methods import CLIENT_SOURCES, refusal
from turnstile_platform.authz.ownership import CallerScope, current_scope, namespace_of
from turnstile_platform.authz.policy import ALLOW_ALL, AuthzDecision

SUBSTRATE = "/turnstile.substrate.v1.SubstrateService"
ADMISSION = "/turnstile.admission.v1.AdmissionService"
ACME = AuthzDecision(True, clients=frozenset({"acme"}), label="acme")
ANY = AuthzDecision(True, any_client=True, label="ops")
RECORDS = {"globex--a": "globex", "legacy": "globex", "old-acme": "acme", "acme--planted": "globex"}


class Owners:
    """An owner lookup over a dict, counting its calls."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    async def __call__(self, sandbox_id: str) -> str | None:
        self.calls.append(sandbox_id)
        return RECORDS.get(sandbox_id)


def _activate(sandbox_id: str, client_id: str | None = None) -> substrate_pb2.ActivateRequest:
    if client_id is None:
        charged = common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())
    else:
        charged = common_pb2.ActivationClient(client_id=client_id)
    return substrate_pb2.ActivateRequest(sandbox_id=sandbox_id, client=charged)


@pytest.mark.parametrize(
    ("sandbox_id", "namespace"),
    [
        ("acme--a", "acme"),
        ("acme--corp--a", "acme"),  # the first separator: acme's, never acme--corp's
        ("acme-corp--a", "acme-corp"),
        ("acme--", None),
        ("--a", None),
        ("acme", None),
        ("acme-a", None),
        ("", None),
    ],
)
def test_an_id_is_in_at_most_one_namespace(sandbox_id: str, namespace: str | None) -> None:
    assert namespace_of(sandbox_id) == namespace


async def test_an_explicit_activate_acts_for_the_sandboxs_owner_too() -> None:
    owners = Owners()
    source = CLIENT_SOURCES[f"{SUBSTRATE}/Activate"]

    async def why(request: Any) -> str | None:
        return await refusal(source, request, ACME, owners)

    # Its own namespace: no lookup (the handler checks the record it reads).
    assert await why(_activate("acme--new", "acme")) is None
    assert owners.calls == []
    # An old id of no namespace recorded to it: one lookup, allowed.
    assert await why(_activate("old-acme", "acme")) is None
    assert owners.calls == ["old-acme"]
    # Another's, recorded or not, namespaced or not: one answer, no owner named.
    answers = {
        sandbox: await why(_activate(sandbox, "acme"))
        for sandbox in ("globex--a", "globex--missing", "legacy", "missing")
    }
    assert answers == {s: f"identity may not act for sandbox {s!r}" for s in answers}
    # The named client is checked first, and may be echoed: the caller sent it.
    assert await why(_activate("acme--a", "globex")) == "identity may not act for client 'globex'"
    # inherit acts for the recorded client alone: no namespace fallback.
    assert (
        await why(_activate("acme--missing")) == "identity may not act for sandbox 'acme--missing'"
    )
    assert await why(_activate("old-acme")) is None


async def test_admit_checks_the_namespace_without_an_owner_record() -> None:
    source = CLIENT_SOURCES[f"{ADMISSION}/Admit"]

    def admit(sandbox_id: str) -> admission_pb2.AdmitRequest:
        return admission_pb2.AdmitRequest(
            sandbox_id=sandbox_id, client=common_pb2.ActivationClient(client_id="acme")
        )

    assert await refusal(source, admit("acme--a"), ACME, None) is None
    for sandbox in ("globex--a", "old-acme"):
        assert await refusal(source, admit(sandbox), ACME, None) == (
            f"identity may not act for sandbox {sandbox!r}"
        )


async def test_reads_act_for_the_recorded_client_and_hide_whose_it_is() -> None:
    owners = Owners()
    for method in ("GetSandbox", "Deactivate"):
        source = CLIENT_SOURCES[f"{SUBSTRATE}/{method}"]
        request_type = getattr(substrate_pb2, f"{method}Request")
        assert await refusal(source, request_type(sandbox_id="old-acme"), ACME, owners) is None
        for sandbox in ("globex--a", "acme--planted", "acme--missing", "missing"):
            got = await refusal(source, request_type(sandbox_id=sandbox), ACME, owners)
            assert got == f"identity may not act for sandbox {sandbox!r}"


async def test_every_admin_method_is_the_platforms_and_needs_any_client() -> None:
    """Limits and the key set apply to every client (SPEC M1): a scope naming the
    very client a request names is not enough."""
    admin = admission_pb2.DESCRIPTOR.services_by_name["AdminService"]
    own = admission_pb2.LimitsTarget(client=common_pb2.ActivationClient(client_id="acme"))
    owners = Owners()
    for method in admin.methods:
        source = CLIENT_SOURCES[f"/{admin.full_name}/{method.name}"]
        request = getattr(admission_pb2, method.input_type.name)()
        if "target" in method.input_type.fields_by_name:
            request.target.CopyFrom(own)
        assert await refusal(source, request, ACME, owners) == (
            "only an identity allowed any client may call this"
        )
        assert await refusal(source, request, ANY, owners) is None
    assert owners.calls == []


class _Policy:
    policy = ALLOW_ALL


async def test_an_identity_allowed_any_client_never_looks_up_an_owner() -> None:
    owners = Owners()
    authorizer = Authorizer(_Policy(), owners)
    for method, request in (
        (f"{SUBSTRATE}/Activate", _activate("globex--a", "acme")),
        (f"{SUBSTRATE}/Activate", _activate("legacy")),
        (f"{SUBSTRATE}/GetSandbox", substrate_pb2.GetSandboxRequest(sandbox_id="legacy")),
    ):
        await authorizer.check_client(None, method, ANY, request)
        assert current_scope() is None
    assert owners.calls == []


def test_a_scope_owns_by_record_then_by_namespace() -> None:
    scope = CallerScope("spiffe://td/client/acme", "/m", ACME, lambda why: None)
    assert scope.owns("globex--a", "acme")  # recorded to acme: acme's
    assert not scope.owns("acme--a", "globex")  # recorded to globex: not acme's
    assert scope.owns("acme--a", None)
    assert not scope.owns("acme--a", None, recorded_only=True)
    assert not scope.owns("plain", None)
    refused = scope.refusal("globex--a")
    assert refused.message == "identity may not act for sandbox 'globex--a': /m"
    assert dict(refused.metadata) == {"identity": "spiffe://td/client/acme", "method": "m"}
