"""Admit responses built from a template per decision shape (``responses.py``)
answer each decision with its own hold, counts and limits, byte for byte what a
response built field by field answers: a template kept for a shape must never
leak one decision's values into the next."""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING, Any

import pytest
import redis.asyncio as aioredis

from turnstile_admission.admitter import AdmitInput, Admitter
from turnstile_admission.decision import Decision
from turnstile_admission.policies import (
    CapSettings,
    ConcurrencySettings,
    Kind,
    Mode,
    RateSettings,
)
from turnstile_admission.redis_store import AdmissionStore
from turnstile_admission.responses import MODES, POLICIES, VERDICTS, AdmitResponses
from turnstile_admission.settings import AdmissionSettings
from turnstile_clientkeys import Client, KeySet, Resolver
from turnstile_clientkeys.contract import KEY_KINDS
from turnstile_contracts import admission_pb2, common_pb2

if TYPE_CHECKING:
    from conftest import LiveSets

ADMITTED = admission_pb2.DECISION_ADMITTED
REFUSED = admission_pb2.DECISION_REFUSED


def field_by_field(decision: Decision) -> admission_pb2.AdmitResponse:
    """The response built without templates, every field from the decision: what
    the servicer answered before responses were templated."""
    admitted = decision.admitted
    response = admission_pb2.AdmitResponse(
        decision=ADMITTED if admitted else REFUSED,
        node=decision.node,
        message=decision.message,
        key=common_pb2.BoundedKey(
            key=decision.key.key,
            kind=KEY_KINDS[decision.key.kind],
            key_set_version=decision.key.version,
        ),
    )
    for v in decision.verdicts:
        response.verdicts.add(
            policy=POLICIES[v.policy],
            mode=MODES[v.mode],
            verdict=VERDICTS[v.verdict],
            limit=v.limit,
            current=v.current,
            detail=v.detail,
        )
    if admitted:
        response.hold_id = decision.hold_id
        response.hold_expires_at.FromMilliseconds(decision.hold_expires_ms)
        return response
    refused = decision.refused_by
    if refused is not None:
        response.refused_by = POLICIES[refused.policy]
        response.limit = refused.limit
        response.current = refused.current
        retry = decision.retry_after_s or 1.0
        response.retry_after.FromMilliseconds(max(1, round(retry * 1000)))
    return response


@pytest.fixture
def admitter(redis: aioredis.Redis, redis_prefix: str, live: LiveSets) -> Admitter:
    """An admitter on the test Redis: acme has a key of its own; two concurrent
    activations, the rest effectively unlimited; rate in shadow with a burst of 3,
    so the fourth decision within a second records a shadow refusal."""
    settings = AdmissionSettings(
        redis_prefix=redis_prefix,
        client_allowlist=("acme",),
        concurrency=ConcurrencySettings(default_limit=2),
        rate=RateSettings(mode=Mode.SHADOW, default_burst=3, default_rate_per_s=0.001),
        cap=CapSettings(default_cap=1000),
    )
    resolver = Resolver(KeySet(version=3, allowlist=frozenset({"acme"})))
    return Admitter(settings, AdmissionStore(redis, settings), resolver)


async def test_every_decision_answers_what_a_field_by_field_response_answers(
    admitter: Admitter,
) -> None:
    responses = AdmitResponses()
    sandboxes = (f"sb-{n}" for n in itertools.count())
    seen: list[Decision] = []

    async def admit(kind: Kind, nodes: tuple[str, ...] = (), client: str = "acme") -> Decision:
        decision = await admitter.admit(
            AdmitInput(next(sandboxes), Client.of(client), kind, candidate_nodes=nodes)
        )
        built = responses.response(decision).SerializeToString(deterministic=True)
        assert built == field_by_field(decision).SerializeToString(deterministic=True)
        seen.append(decision)
        return decision

    # Each shape at least twice, its values changing: the lease count, the
    # slots held, the bucket, the hold and its expiry, then a refusal.
    for _ in range(2):
        await admit(Kind.COLD_CREATE, ("n1", "n2"))
        await admit(Kind.RESUME)
        await admit(Kind.WARM_CLAIM, client="someone-else")
    refusals = [await admit(Kind.COLD_CREATE, ("n1",)) for _ in range(2)]
    # A new key-set version: the same shapes answer the new version.
    admitter.resolver.swap(KeySet(version=4, allowlist=frozenset({"acme"})))
    later = await admit(Kind.RESUME)

    assert not any(d.admitted for d in refusals)
    assert later.key.version == 4
    admitted = [d for d in seen if d.admitted]
    assert len({d.hold_id for d in admitted}) == len(admitted)
    # Shapes were shared: far fewer templates than decisions.
    assert len({id(d.shape) for d in seen}) < len(seen)


async def test_decisions_of_one_shape_each_answer_their_own_hold_and_counts(
    start_admission: Any,
) -> None:
    running = await start_admission(client_allowlist=("acme",), concurrency={"default_limit": 5})

    def cold(sandbox: str) -> Any:
        return admission_pb2.AdmitRequest(
            sandbox_id=sandbox,
            client=common_pb2.ActivationClient(client_id="acme"),
            kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
            candidate_nodes=["n1"],
        )

    answers = [await running.stub.Admit(cold(f"sb-{n}")) for n in range(3)]

    assert [a.decision for a in answers] == [ADMITTED] * 3
    assert len({a.hold_id for a in answers}) == 3
    assert all(a.hold_expires_at.seconds > 0 for a in answers)
    for n, answer in enumerate(answers):  # each counts the leases and slots before it
        by_policy = {v.policy: v for v in answer.verdicts}
        assert (
            by_policy[admission_pb2.POLICY_CONCURRENCY].limit,
            by_policy[admission_pb2.POLICY_CONCURRENCY].current,
        ) == (5, n)
        assert by_policy[admission_pb2.POLICY_NODE_SLOTS].current == n
        assert answer.node == "n1"


async def test_a_refusal_and_an_admission_of_one_key_answer_apart(start_admission: Any) -> None:
    running = await start_admission(client_allowlist=("acme",), concurrency={"default_limit": 1})

    def resume(sandbox: str) -> Any:
        return admission_pb2.AdmitRequest(
            sandbox_id=sandbox,
            client=common_pb2.ActivationClient(client_id="acme"),
            kind=common_pb2.ACTIVATION_KIND_RESUME,
        )

    first = await running.stub.Admit(resume("sb-1"))
    refused = await running.stub.Admit(resume("sb-2"))
    await running.stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=first.hold_id))
    again = await running.stub.Admit(resume("sb-3"))

    assert (first.decision, refused.decision, again.decision) == (ADMITTED, REFUSED, ADMITTED)
    assert refused.hold_id == ""
    assert not refused.HasField("hold_expires_at")
    assert refused.refused_by == admission_pb2.POLICY_CONCURRENCY
    assert (refused.limit, refused.current) == (1, 1)
    assert refused.HasField("retry_after")
    assert refused.message.startswith("refused by concurrency for key acme")
    assert again.hold_id not in ("", first.hold_id)
    assert again.refused_by == admission_pb2.POLICY_UNSPECIFIED
    assert not again.HasField("retry_after")
    assert again.message == first.message == "admitted for key acme"
    assert again.key == first.key == refused.key


async def test_a_new_key_set_resolves_each_client_anew(admitter: Admitter) -> None:
    """Bounded keys are remembered per key-set snapshot, never across one."""

    async def key_of(sandbox: str) -> tuple[str, int]:
        decision = await admitter.admit(AdmitInput(sandbox, Client.of("acme"), Kind.RESUME))
        return decision.key.key, decision.key.version

    assert await key_of("sb-1") == await key_of("sb-2") == ("acme", 3)
    admitter.resolver.swap(KeySet(version=4, allowlist=frozenset()))
    assert await key_of("sb-3") == ("shared", 4)
