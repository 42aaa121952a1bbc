"""The pytest plugin every Turnstile test suite loads (``-p turnstile_testing.plugin``).

Fixtures give each test real services, isolated: its own Redis key prefix and
its own PostgreSQL database. See :mod:`turnstile_testing.services` for the
order in which servers are found or started.
"""

from __future__ import annotations

import gc
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest
import redis.asyncio as aioredis
from redis.asyncio.cluster import RedisCluster

from turnstile_platform.sandbox_credentials import generate_key_pair
from turnstile_testing.otlp import OtlpReceiver
from turnstile_testing.pgbouncer import PgBouncerProcess, pgbouncer_binary
from turnstile_testing.pki import Pki
from turnstile_testing.processes import PostgresProcess, RedisProcess
from turnstile_testing.redis_cluster import RedisClusterServers, running_cluster
from turnstile_testing.redis_sentinel import RedisSentinelSet, running_sentinel_set
from turnstile_testing.redis_topologies import InitializedCluster, connect, default_topology
from turnstile_testing.replication import PostgresPair
from turnstile_testing.services import find_postgres, find_redis, using

# The shared fixtures start services in explicit loopback plaintext (SPEC Z5 allows
# it there); tests of TLS and authorization turn mTLS on with the ``pki`` fixture.
# Subprocesses that should run mTLS (the stack) drop ``TURNSTILE_*`` variables.
os.environ.setdefault("TURNSTILE_PLAINTEXT", "true")


@pytest.fixture
def pki(tmp_path: Path) -> Pki:
    """A CA of this test's own that issues SPIFFE certificates and writes policies."""
    return Pki(tmp_path / "pki")


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "redis_topologies(*names): also run the test with redis_url on these Redis "
        "topologies (single, sentinel, cluster), in every run",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    marker = metafunc.definition.get_closest_marker("redis_topologies")
    if marker is not None and "redis_topology" in metafunc.fixturenames:
        names = list(dict.fromkeys((default_topology(), *marker.args)))
        metafunc.parametrize("redis_topology", names, indirect=True)


def pytest_collection_finish(session: pytest.Session) -> None:
    """Everything alive once the tests are collected (every module, every test item)
    stays alive to the end: moved out of the collector's sight, a full garbage
    collection walks only what the tests themselves make."""
    gc.collect()
    gc.freeze()


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """For tests that time calls in milliseconds: the heap earlier tests left is
    collected, and what survives is moved out of the collector's sight for this
    test, so a full collection of it cannot land inside a timed call (in a full
    run such pauses reached hundreds of ms and tripled a p99). Afterwards this
    test's garbage is collected and the survivors are frozen again."""
    gc.collect()
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
        gc.collect()
        gc.freeze()


@pytest.fixture
def redis_topology(request: pytest.FixtureRequest) -> str:
    """The Redis topology behind this test's ``redis_url`` (see
    :mod:`turnstile_testing.redis_topologies`)."""
    return str(getattr(request, "param", default_topology()))


@pytest.fixture(scope="session")
def single_redis_url() -> Iterator[str]:
    """URL of the shared test Redis server (found or started once per session)."""
    with using(find_redis()) as url:
        yield url


@pytest.fixture(scope="session")
def redis_sentinel() -> Iterator[RedisSentinelSet]:
    """A Sentinel-managed Redis (a primary, a replica, three sentinels), once per session."""
    with running_sentinel_set() as servers:
        yield servers


@pytest.fixture
def redis_url(request: pytest.FixtureRequest, redis_topology: str) -> str:
    """URL of the shared test Redis of this test's topology; the servers of each
    topology start once per session, when a test first needs them."""
    if redis_topology == "cluster":
        cluster: RedisClusterServers = request.getfixturevalue("redis_cluster")
        return cluster.seeds_url
    if redis_topology == "sentinel":
        sentinel: RedisSentinelSet = request.getfixturevalue("redis_sentinel")
        return sentinel.url
    return str(request.getfixturevalue("single_redis_url"))


@pytest.fixture
def redis_prefix() -> str:
    """A key prefix no other test uses: each test's Redis state is its own."""
    return f"t:{uuid.uuid4().hex[:12]}:"


@pytest.fixture
async def redis(redis_url: str, redis_prefix: str) -> AsyncIterator[aioredis.Redis | RedisCluster]:
    """A client to the shared test Redis (of any topology); the test's keys are
    deleted afterwards."""
    client = connect(redis_url)
    try:
        yield client
    finally:
        # On a Cluster, scan_iter walks every master and DEL splits the keys by slot.
        keys = [key async for key in client.scan_iter(match=f"{redis_prefix}*", count=1000)]
        if keys:
            await client.delete(*keys)
        await client.aclose()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[RedisClusterServers]:
    """A Redis Cluster (3 masters with a replica each), started once per session."""
    with running_cluster(replicas=1) as servers:
        yield servers


@pytest.fixture
async def redis_cluster_client(
    redis_cluster: RedisClusterServers, redis_prefix: str
) -> AsyncIterator[RedisCluster]:
    """A cluster client (redis-py's ``RedisCluster``: routes by slot, follows MOVED);
    the test's keys are deleted afterwards, on whichever master holds them."""
    client = InitializedCluster.from_url(redis_cluster.url)
    try:
        yield client
    finally:
        # scan_iter walks every master; DEL of one key goes to the one that holds it.
        async for key in client.scan_iter(match=f"{redis_prefix}*", count=1000):
            await client.delete(key)
        await client.aclose()


@pytest.fixture(scope="session")
def postgres_url() -> Iterator[str]:
    """URL of the shared test PostgreSQL's maintenance database."""
    with using(find_postgres()) as url:
        yield url


@pytest.fixture
async def database_url(postgres_url: str) -> AsyncIterator[str]:
    """A fresh, empty database for this test alone, dropped afterwards."""
    name = f"t_{uuid.uuid4().hex[:16]}"
    admin = await asyncpg.connect(postgres_url)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    base, _, _ = postgres_url.rpartition("/")
    try:
        yield f"{base}/{name}"
    finally:
        admin = await asyncpg.connect(postgres_url)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


@pytest.fixture(scope="session")
def pgbouncer(postgres_url: str) -> Iterator[PgBouncerProcess]:
    """A real PgBouncer in transaction mode, with a pool smaller than its clients, in front
    of the shared test PostgreSQL (started once per session). Tests that use it skip where
    the binary is not installed (``scripts/test`` installs it)."""
    if pgbouncer_binary() is None:
        pytest.skip("pgbouncer is not installed (scripts/test installs it)")
    proc = PgBouncerProcess(postgres_url).start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture
def pgbouncer_database_url(pgbouncer: PgBouncerProcess, database_url: str) -> str:
    """This test's own database, reached through :func:`pgbouncer` (transaction mode)."""
    return pgbouncer.url(database_url)


@pytest.fixture
def private_redis() -> Iterator[RedisProcess]:
    """A Redis server of this test's own, which the test may stop and restart."""
    proc = RedisProcess().start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture
def private_redis_cluster() -> Iterator[RedisClusterServers]:
    """A Redis Cluster of this test's own (3 masters with a replica each), which the
    test may fail over, pause or stop."""
    with running_cluster(replicas=1) as servers:
        yield servers


@pytest.fixture
def private_redis_sentinel() -> Iterator[RedisSentinelSet]:
    """A Sentinel-managed Redis of this test's own, whose primary the test may kill."""
    with running_sentinel_set() as servers:
        yield servers


@pytest.fixture
def private_postgres() -> Iterator[PostgresProcess]:
    """A PostgreSQL cluster of this test's own, which the test may stop and restart."""
    proc = PostgresProcess().start()
    try:
        yield proc
    finally:
        proc.close()


@pytest.fixture
def postgres_pair() -> Iterator[PostgresPair]:
    """A private primary with a streaming standby, which the test may switch over."""
    pair = PostgresPair().start()
    try:
        yield pair
    finally:
        pair.close()


@pytest.fixture
async def otlp_receiver() -> AsyncIterator[OtlpReceiver]:
    """A real OTLP/gRPC receiver on a free port."""
    receiver = await OtlpReceiver().start()
    try:
        yield receiver
    finally:
        await receiver.stop()


@dataclass(frozen=True)
class CredentialKeyFiles:
    """A sandbox-credential key pair of this test's own (SPEC Z3)."""

    #: The substrate's ``TURNSTILE_WORKER_CREDENTIAL_SIGNING_KEY_FILE``.
    signing_key_file: Path
    #: The relay's ``TURNSTILE_WORKER_CREDENTIAL_PUBLIC_KEYS_FILE``.
    public_keys_file: Path


@pytest.fixture
def credential_keys(tmp_path_factory: pytest.TempPathFactory) -> CredentialKeyFiles:
    """A fresh Ed25519 key pair for minting and verifying sandbox credentials."""
    directory = tmp_path_factory.mktemp("credential-keys")
    keys = CredentialKeyFiles(directory / "signing.pem", directory / "public.pem")
    generate_key_pair(keys.signing_key_file, keys.public_keys_file)
    return keys
