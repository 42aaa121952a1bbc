"""PostgreSQL round trips of the hot path, counted on the wire (a proxy between the service
and PostgreSQL counts the server's ``ReadyForQuery`` messages, one per exchange).

An Activate of a sandbox that already runs is one primary-key read: one round trip. The
pool's release adds none (no reset query: ``turnstile_platform.postgres``)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import TYPE_CHECKING
from urllib.parse import urlsplit, urlunsplit

import pytest

from turnstile_contracts import substrate_pb2
from turnstile_testing.pg_wire import ReadyForQueryCounter
from turnstile_testing.tcp_proxy import TcpProxy

if TYPE_CHECKING:
    from conftest import StartService


@pytest.fixture
async def counted_url(migrated_url: str) -> AsyncIterator[tuple[str, ReadyForQueryCounter]]:
    """The migrated database's URL through a proxy that counts round trips."""
    counter = ReadyForQueryCounter()
    target = urlsplit(migrated_url)
    async with TcpProxy(
        target.hostname or "127.0.0.1", target.port or 5432, observe=counter.observer
    ) as proxy:
        netloc = f"{target.username or 'postgres'}@127.0.0.1:{proxy.port}"
        yield urlunsplit(target._replace(netloc=netloc)), counter


async def test_an_already_running_activate_is_one_postgres_round_trip(
    counted_url: tuple[str, ReadyForQueryCounter], start_service: StartService
) -> None:
    url, counter = counted_url
    harness = await start_service(
        url,
        database_sslmode="disable",  # the proxy reads the protocol: no TLS
        database_pool_min=1,
        database_pool_max=1,
        health_check_interval_s=60,  # no health check statement in the window
    )
    created = await harness.activate("sb-1", "acme")
    assert created.outcome == substrate_pb2.OUTCOME_CREATED
    # The first already-running read prepares its statement (a round trip of its own,
    # then cached on the connection): count from the second.
    await harness.activate("sb-1", "acme")

    before = counter.count
    calls = 20
    for _ in range(calls):
        again = await harness.activate("sb-1", "acme")
        assert again.outcome == substrate_pb2.OUTCOME_ALREADY_RUNNING

    assert counter.count - before == calls
