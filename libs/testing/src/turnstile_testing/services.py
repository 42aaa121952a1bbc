"""Finding the Redis and PostgreSQL the tests use, in a fixed order:

1. URLs from the environment (``TURNSTILE_TEST_REDIS_URL``, ``TURNSTILE_TEST_DATABASE_URL``);
2. servers already running on the standard local ports;
3. binaries started by the kit in a temporary directory;
4. testcontainers, only where a Docker engine answers.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from turnstile_testing.processes import PostgresProcess, RedisProcess, port_open


@dataclass
class Found:
    url: str
    how: str
    close: Callable[[], None] = field(default=lambda: None)


def _docker_answers() -> bool:
    if shutil.which("docker") is None:
        return False
    try:
        result = subprocess.run(["docker", "info"], capture_output=True, timeout=5, check=False)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def find_redis() -> Found:
    if url := os.environ.get("TURNSTILE_TEST_REDIS_URL"):
        return Found(url, "environment")
    if port_open("127.0.0.1", 6379):
        return Found("redis://127.0.0.1:6379/0", "local server")
    if shutil.which("redis-server"):
        proc = RedisProcess().start()
        return Found(proc.url, "started by the test kit", proc.close)
    if _docker_answers():
        from testcontainers.redis import RedisContainer  # type: ignore[import-not-found]

        container = RedisContainer().start()
        host, port = container.get_container_host_ip(), container.get_exposed_port(6379)
        return Found(f"redis://{host}:{port}/0", "testcontainers", container.stop)
    raise RuntimeError("no Redis: set TURNSTILE_TEST_REDIS_URL or install redis-server")


def find_postgres() -> Found:
    if url := os.environ.get("TURNSTILE_TEST_DATABASE_URL"):
        return Found(url, "environment")
    if port_open("127.0.0.1", 5432):
        return Found("postgresql://postgres@127.0.0.1:5432/postgres", "local server")
    with contextlib.suppress(RuntimeError):
        proc = PostgresProcess().start()
        return Found(proc.url, "started by the test kit", proc.close)
    if _docker_answers():
        from testcontainers.postgres import PostgresContainer  # type: ignore[import-not-found]

        container = PostgresContainer("postgres:16", driver=None).start()
        return Found(container.get_connection_url(), "testcontainers", container.stop)
    raise RuntimeError("no PostgreSQL: set TURNSTILE_TEST_DATABASE_URL or install PostgreSQL")


@contextlib.contextmanager
def using(found: Found) -> Iterator[str]:
    try:
        yield found.url
    finally:
        found.close()
