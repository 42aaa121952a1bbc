"""The authorization policy (SPEC Z2): default deny, exact and prefix identities,
client scopes, validation of the file, and live reload on the real bootstrap."""

from __future__ import annotations

import asyncio
from typing import Any

import grpc
import grpc.aio
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from turnstile_platform.authz.methods import all_methods
from turnstile_platform.authz.policy import PolicyError, parse_policy
from turnstile_platform.authz.watcher import POLICY_HEALTH_NAME
from turnstile_platform.errors import decode
from turnstile_platform.server import GrpcService
from turnstile_testing.pki import Pki
from turnstile_testing.probe import add_probe, call, settings

TD = "spiffe://turnstile.test"
ADMIT = "turnstile.admission.v1.AdmissionService/Admit"
USAGE = "turnstile.admission.v1.AdmissionService/GetUsage"
ATTACH = "turnstile.affinity.v1.AffinityService/Attach"
PLACE = "turnstile.affinity.v1.AffinityService/Place"

POLICY = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/service/substrate"]
methods = ["turnstile.admission.v1.AdmissionService/*"]
clients = "any"

[[allow]]
identities = ["{TD}/client/*"]
methods = ["{ADMIT}", "{USAGE}"]
clients = "self"

[[allow]]
identities = ["{TD}/client/ops"]
methods = ["{USAGE}"]
clients = ["acme", "globex"]

[[allow]]
identities = ["{TD}/sandbox"]
methods = ["{ATTACH}"]
"""


def test_default_deny_and_method_grants() -> None:
    policy = parse_policy(POLICY, known_methods=all_methods())
    assert policy.decide(f"{TD}/service/substrate", ADMIT).allowed
    assert not policy.decide(f"{TD}/service/substrate", PLACE).allowed
    assert policy.decide(f"{TD}/sandbox", "/" + ATTACH).allowed
    assert not policy.decide(f"{TD}/sandbox", PLACE).allowed
    assert not policy.decide(f"{TD}/sandboxes", ATTACH).allowed
    assert not policy.decide("spiffe://elsewhere/service/substrate", ADMIT).allowed


def test_client_scopes_any_self_and_lists_add_up() -> None:
    policy = parse_policy(POLICY, known_methods=all_methods())
    assert policy.decide(f"{TD}/service/substrate", ADMIT).allows_client("anyone")
    acme = policy.decide(f"{TD}/client/acme", ADMIT)
    assert acme.allows_client("acme")
    assert not acme.allows_client("globex")
    assert not acme.allows_client(None)
    ops = policy.decide(f"{TD}/client/ops", USAGE)
    assert ops.allows_client("ops")
    assert ops.allows_client("globex")
    assert not ops.allows_client("initech")
    # A rule without clients grants its methods but acts for no client.
    assert not policy.decide(f"{TD}/sandbox", ATTACH).allows_client("acme")


def test_self_is_one_exact_segment_of_the_declared_template() -> None:
    policy = parse_policy(POLICY, known_methods=all_methods())
    for identity in (
        f"{TD}/client/acme/globex",  # nested: not the template's one segment
        f"{TD}/client",
        f"{TD}/client/native",  # a reserved key belongs to the platform
        "spiffe://elsewhere/client/acme",
    ):
        decision = policy.decide(identity, ADMIT)
        for client in ("acme", "globex", "native", "client", ""):
            assert not decision.allows_client(client), (identity, client)
    assert policy.decide(f"{TD}/client/acme", ADMIT).allows_client("acme")


def test_a_rule_may_declare_its_own_template() -> None:
    text = f"""
self = "{TD}/client/{{client}}"

[[allow]]
identities = ["{TD}/tenant/*"]
methods = ["{USAGE}"]
clients = "self"
self = "{TD}/tenant/{{client}}/control"
"""
    policy = parse_policy(text, known_methods=all_methods())
    assert policy.decide(f"{TD}/tenant/acme/control", USAGE).allows_client("acme")
    assert not policy.decide(f"{TD}/tenant/acme", USAGE).allows_client("acme")
    assert not policy.decide(f"{TD}/tenant/acme/other", USAGE).allows_client("acme")


def test_metric_labels_are_the_policys_names() -> None:
    policy = parse_policy(POLICY, known_methods=all_methods())
    assert policy.decide(f"{TD}/client/acme", ADMIT).label == f"{TD}/client/*"
    assert policy.decide(f"{TD}/client/ops", USAGE).label == f"{TD}/client/ops"
    assert policy.decide("spiffe://x/y", ADMIT).label == "other"
    assert policy.labels == {
        "other",
        f"{TD}/service/substrate",
        f"{TD}/client/*",
        f"{TD}/client/ops",
        f"{TD}/sandbox",
    }


@pytest.mark.parametrize(
    ("text", "complaint"),
    [
        ("[[allow]\n", "not valid TOML"),
        ('[[allow]]\nidentities = ["x"]\nmethods = ["*"]\n', "not a SPIFFE ID"),
        (f'[[allow]]\nidentities = ["{TD}/a*b"]\nmethods = ["*"]\n', "last path segment"),
        (f'[[allow]]\nidentities = ["{TD}/a"]\nmethods = ["nope.S/M"]\n', "no method"),
        (f'[[allow]]\nidentities = ["{TD}/a"]\nmethods = ["nope.S/*"]\n', "no service"),
        (f'[[allow]]\nidentities = ["{TD}/a"]\nmethods = ["*"]\nclients = "all"\n', "clients"),
        (f'[[allow]]\nidentities = ["{TD}/a"]\nmethod = ["*"]\n', "unknown keys"),
        ('[[rule]]\nidentities = ["*"]\n', "unknown top-level"),
        (
            f'[[allow]]\nidentities = ["{TD}/a"]\nmethods = ["*"]\nclients = "self"\n',
            '"self" needs an identity template',
        ),
        (f'self = "{TD}/client/acme"\n', "exactly once"),
        (f'self = "{TD}/client/{{client}}/{{client}}"\n', "exactly once"),
        (f'self = "{TD}/client/x{{client}}"\n', "whole path segment"),
        ('self = "https://td/{client}"\n', "not a SPIFFE ID"),
        (
            f'[[allow]]\nidentities = ["{TD}/a"]\nmethods = ["*"]\nclients = "any"\n'
            f'self = "{TD}/a/{{client}}"\n',
            "only for clients",
        ),
    ],
)
def test_invalid_files_are_refused_with_the_reason(text: str, complaint: str) -> None:
    with pytest.raises(PolicyError, match=complaint):
        parse_policy(text, known_methods=all_methods())


async def _echo(payload: bytes, _: grpc.aio.ServicerContext[Any, Any]) -> bytes:
    return payload


ONLY_ADMISSION = f"""
[[allow]]
identities = ["{TD}/client/acme"]
methods = ["turnstile.admission.v1.AdmissionService/*"]
"""
EVERYTHING = f"""
[[allow]]
identities = ["{TD}/client/acme"]
methods = ["*"]
"""


async def _policy_status(channel: grpc.aio.Channel) -> int:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(service=POLICY_HEALTH_NAME)
    )
    status: int = response.status
    return status


async def test_a_changed_policy_applies_on_every_replica_and_a_broken_one_keeps_the_last_good(
    pki: Pki,
) -> None:
    overrides = pki.server_settings(policy=ONLY_ADMISSION)
    replicas = [GrpcService("probe", settings(**overrides), service_names=[]) for _ in range(2)]
    for replica in replicas:
        add_probe(replica, {"Echo": _echo})
        await replica.start()
    app, other = replicas
    assert app.policy is not None
    assert other.policy is not None
    channel = pki.identity("client/acme").channel(app.address)
    other_channel = pki.identity("client/acme").channel(other.address)
    try:
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await call(channel, "Echo")
        error = decode(refused.value)
        assert error.code == grpc.StatusCode.PERMISSION_DENIED
        assert error.reason == "PERMISSION_DENIED"
        assert error.metadata == {"identity": f"{TD}/client/acme", "method": "test.Probe/Echo"}

        app.policy.reloaded.clear()
        other.policy.reloaded.clear()
        pki.policy(EVERYTHING)
        # The watchers poll every 0.05 s here (0.5 s by default): well within a second.
        await asyncio.wait_for(app.policy.reloaded.wait(), 10)
        await asyncio.wait_for(other.policy.reloaded.wait(), 10)
        assert await call(channel, "Echo", b"now") == b"now"
        assert await call(other_channel, "Echo", b"there") == b"there"
        assert await _policy_status(channel) == health_pb2.HealthCheckResponse.SERVING

        app.policy.reloaded.clear()
        pki.policy("[[allow]\nbroken")
        await asyncio.wait_for(app.policy.reloaded.wait(), 10)
        assert not app.policy.valid
        assert "not valid TOML" in (app.policy.last_error or "")
        assert await _policy_status(channel) == health_pb2.HealthCheckResponse.NOT_SERVING
        assert await call(channel, "Echo", b"kept") == b"kept"  # the last good policy
        overall = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest())
        assert overall.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await channel.close(None)
        await other_channel.close(None)
        for replica in replicas:
            await replica.stop()


async def test_reflection_is_open_to_any_identity_and_health_to_all(pki: Pki) -> None:
    nothing = f'[[allow]]\nidentities = ["{TD}/service/admission"]\nmethods = ["{PLACE}"]\n'
    app = GrpcService("probe", settings(**pki.server_settings(policy=nothing)), service_names=[])
    await app.start()
    try:
        async with pki.identity("client/acme").channel(app.address) as channel:
            stub = reflection_pb2_grpc.ServerReflectionStub(channel)
            request = reflection_pb2.ServerReflectionRequest(list_services="")
            responses = [r async for r in stub.ServerReflectionInfo(iter([request]))]
            names = {s.name for s in responses[0].list_services_response.service}
            assert "grpc.health.v1.Health" in names
            health = await health_pb2_grpc.HealthStub(channel).Check(
                health_pb2.HealthCheckRequest()
            )
            assert health.status == health_pb2.HealthCheckResponse.SERVING
    finally:
        await app.stop()


def test_an_invalid_policy_at_start_fails_start_up(pki: Pki) -> None:
    with pytest.raises(PolicyError):
        GrpcService("probe", settings(**pki.server_settings(policy="allow = 3")), service_names=[])
