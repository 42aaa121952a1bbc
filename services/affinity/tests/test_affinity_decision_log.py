"""Affinity's side of the decision log (SPEC Q3): each Place's outcome, or why it
was refused, appended under the call's trace id, off the call's path, to the
stream of the client's key (SPEC N3: affinity knows no key set, so a client whose
own key admission never logged is the shared key's)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from turnstile_platform.decision_log import key_stream
from turnstile_platform.errors import RichError
from turnstile_testing.eventually import eventually

if TYPE_CHECKING:
    from conftest import StartAffinity, StartWorker


async def test_each_place_is_logged_with_its_outcome_or_refusal(
    affinity: StartAffinity, worker: StartWorker, redis: Any, redis_prefix: str
) -> None:
    service = await affinity(tiers="a")
    await worker(service.address, "a1", "a", capacity=2)
    await service.place("chat", "a")  # first
    await service.place("chat", "a")  # hit: its sandbox's second turn
    refused = await service.refused("chat", "a")  # busy: 2 of 2 turns
    assert isinstance(refused, RichError)

    async def three() -> list[dict[str, str]] | None:
        raw = await redis.xrange(key_stream(redis_prefix, "shared"))
        found = [{k.decode(): v.decode() for k, v in fields.items()} for _, fields in raw]
        return found if len(found) == 3 else None

    found = await eventually(three)
    assert found is not None
    first, hit, other = found
    assert {e["service"] for e in (first, hit, other)} == {"affinity"}
    assert (first["kind"], first["sandbox"], hit["kind"]) == ("first", "a1", "hit")
    assert first["detail"] == "session chat first on a1"
    expected = {"SANDBOX_BUSY": "busy", "TIER_EXHAUSTED": "exhausted", "SANDBOX_PENDING": "pending"}
    assert other["kind"] == expected[refused.reason]
    assert other["detail"].startswith("session chat: ")
    assert other["sandbox"] == "a1"
    assert {e["client"] for e in (first, hit, other)} == {"acme"}  # conftest's TENANT
