"""The live part of the cap: the substrate's ``CountLiveSandboxes``, with a short
deadline, and the pending ids the count is asked about.

The count needs the key's pending ids *before* the decision script runs (so the
substrate can say which of them it already sees live), yet a decision must stay
one Redis script. So the ids come from :class:`PendingIdCache`: every script
answer carries the key's pending ids, and the next decision for that key asks
about them. Ids added since (by another replica, or concurrently) were not asked
about; ``admit.lua`` counts them conservatively and, only when they alone decide
the cap verdict, asks for one recount with the full list (see docs/admission.md).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import grpc.aio

from turnstile_contracts import substrate_pb2, substrate_pb2_grpc

#: The substrate refuses longer lists.
MAX_PENDING_IDS = 10_000


@dataclass(frozen=True)
class LiveCount:
    """A key's live sandboxes (excluding the one being activated), or unknown.

    Two unknowns, never to be confused: ``unsupported`` (the substrate cannot
    count at all, as Direct: the cap answers UNKNOWN and admits, SPEC S4) and
    *unavailable* (the count timed out, failed, or is not current): a lower bound
    of zero, so the cap still refuses on the pending set alone (SPEC P1).
    """

    live: int | None
    asked: tuple[str, ...] = ()
    live_pending: tuple[str, ...] = ()
    detail: str = ""
    unsupported: bool = False

    @property
    def known(self) -> bool:
        return self.live is not None


class LiveCounter:
    """Asks the substrate; never raises: a failure is an unavailable count (SPEC P1)."""

    def __init__(
        self, stub: substrate_pb2_grpc.SubstrateServiceAsyncStub, timeout_s: float
    ) -> None:
        self._stub = stub
        self._timeout_s = timeout_s

    async def count(self, key: str, exclude: str, pending_ids: Sequence[str]) -> LiveCount:
        asked = tuple(pending_ids[:MAX_PENDING_IDS])
        request = substrate_pb2.CountLiveSandboxesRequest(
            key=key, exclude_sandbox_id=exclude, pending_sandbox_ids=asked
        )
        try:
            response = await self._stub.CountLiveSandboxes(request, timeout=self._timeout_s)
        except grpc.aio.AioRpcError as error:
            return LiveCount(None, asked, detail=f"substrate unreachable: {error.code().name}")
        if response.WhichOneof("result") != "known":
            reason = substrate_pb2.UnknownReason.Name(response.unknown.reason)
            detail = f"live count unknown: {reason}"
            if response.unknown.detail:
                detail += f" ({response.unknown.detail})"
            unsupported = response.unknown.reason == substrate_pb2.UNKNOWN_REASON_UNSUPPORTED
            return LiveCount(None, asked, detail=detail, unsupported=unsupported)
        known = response.known
        return LiveCount(known.live, asked, tuple(known.live_pending_sandbox_ids))


class PendingIdCache:
    """The pending ids of each bounded key, as the last decision for it saw them.

    Bounded by the key set (one entry per bounded key), never by callers.
    """

    def __init__(self) -> None:
        self._ids: dict[str, tuple[str, ...]] = {}

    def get(self, key: str) -> tuple[str, ...]:
        return self._ids.get(key, ())

    def put(self, key: str, ids: tuple[str, ...]) -> None:
        self._ids[key] = ids
