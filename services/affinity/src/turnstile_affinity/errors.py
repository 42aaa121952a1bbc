"""The affinity store being unreachable, as the rich error every RPC answers with."""

from __future__ import annotations

from types import TracebackType

import grpc

from turnstile_contracts import common_pb2
from turnstile_platform.bounded import OverloadedError
from turnstile_platform.errors import RichError, reason_name, replica_overloaded
from turnstile_platform.redis_client import UNREACHABLE


class store_reachable:  # noqa: N801 - used as ``with store_reachable(...)``, like a function
    """Turn "Redis could not be reached" into UNAVAILABLE / DEPENDENCY_UNAVAILABLE,
    and a Redis call held up by this replica's own overload into UNAVAILABLE /
    REPLICA_OVERLOADED.

    A class rather than ``contextlib.contextmanager``: Place and ReleaseLease enter
    one per call, and the generator-based manager cost about 0.7 µs each
    (docs/performance.md)."""

    __slots__ = ("_retry_after_s",)

    def __init__(self, retry_after_s: float) -> None:
        self._retry_after_s = retry_after_s

    def __enter__(self) -> None:
        return None

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if error is None:
            return
        if isinstance(error, OverloadedError):
            raise replica_overloaded("redis", self._retry_after_s) from error
        if isinstance(error, UNREACHABLE):
            raise RichError(
                grpc.StatusCode.UNAVAILABLE,
                "the affinity store (Redis) could not be reached",
                reason=reason_name(common_pb2.ERROR_REASON_DEPENDENCY_UNAVAILABLE),
                metadata={"dependency": "redis"},
                retry_after_s=self._retry_after_s,
            ) from error
