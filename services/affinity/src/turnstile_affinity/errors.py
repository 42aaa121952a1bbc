"""The affinity store being unreachable, as the rich error every RPC answers with."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from turnstile_contracts import common_pb2
from turnstile_platform.bounded import OverloadedError
from turnstile_platform.errors import RichError, reason_name, replica_overloaded
from turnstile_platform.redis_client import UNREACHABLE


@contextmanager
def store_reachable(retry_after_s: float) -> Iterator[None]:
    """Turn "Redis could not be reached" into UNAVAILABLE / DEPENDENCY_UNAVAILABLE,
    and a Redis call held up by this replica's own overload into UNAVAILABLE /
    REPLICA_OVERLOADED."""
    try:
        yield
    except OverloadedError as error:
        raise replica_overloaded("redis", retry_after_s) from error
    except UNREACHABLE as error:
        raise RichError(
            grpc.StatusCode.UNAVAILABLE,
            "the affinity store (Redis) could not be reached",
            reason=reason_name(common_pb2.ERROR_REASON_DEPENDENCY_UNAVAILABLE),
            metadata={"dependency": "redis"},
            retry_after_s=retry_after_s,
        ) from error
