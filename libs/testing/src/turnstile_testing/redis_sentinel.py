"""A real Sentinel-managed Redis on loopback ports: a primary, a replica, three sentinels.

What users run for failover (SPEC F2): the sentinels watch the primary, agree
(quorum 2) that it is down after ``down_after_ms`` and promote the replica.
The sentinels are the same binary as the servers (``redis-server sentinel.conf
--sentinel``) and rewrite their config file as they learn the topology, so each
gets one of its own. Nothing is persisted; :meth:`RedisSentinelSet.close` kills
every process and removes their directories.
"""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import redis

from turnstile_testing.processes import RedisProcess, free_port, port_open

SERVICE = "turnstile"


class SentinelProcess:
    """One ``redis-server --sentinel`` monitoring ``SERVICE``."""

    def __init__(self, primary_port: int, *, down_after_ms: int, failover_timeout_ms: int) -> None:
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="turnstile-sentinel-"))
        self.config = self.dir / "sentinel.conf"
        self.config.write_text(
            f"port {self.port}\n"
            "bind 127.0.0.1\n"
            f"dir {self.dir}\n"
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} 2\n"
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}\n"
            f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}\n"
            f"sentinel parallel-syncs {SERVICE} 1\n"
        )
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self) -> SentinelProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        self._proc = subprocess.Popen(
            [binary, str(self.config), "--sentinel", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        return self

    def close(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisSentinelSet:
    """A primary, one replica and three sentinels (quorum 2) for ``SERVICE``."""

    def __init__(self, *, down_after_ms: int = 1000, failover_timeout_ms: int = 5000) -> None:
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.servers: list[RedisProcess] = []
        self.sentinels: list[SentinelProcess] = []

    @property
    def url(self) -> str:
        """The ``redis+sentinel://`` URL Turnstile's settings take."""
        hosts = ",".join(f"127.0.0.1:{sentinel.port}" for sentinel in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}/0"

    def start(self, timeout_s: float = 30.0) -> RedisSentinelSet:
        primary = RedisProcess().start()
        self.servers.append(primary)
        replica = RedisProcess(options=("--replicaof", "127.0.0.1", str(primary.port)))
        self.servers.append(replica.start())
        self.sentinels = [
            SentinelProcess(
                primary.port,
                down_after_ms=self.down_after_ms,
                failover_timeout_ms=self.failover_timeout_ms,
            ).start()
            for _ in range(3)
        ]
        deadline = time.monotonic() + timeout_s
        while not self._ready():
            if time.monotonic() > deadline:
                raise TimeoutError(f"Sentinel set not ready within {timeout_s:.0f}s")
            time.sleep(0.05)
        return self

    def primary_port(self) -> int:
        """The port the sentinels name as the primary now."""
        with self._sentinel(self.sentinels[0]) as client:
            _, port = client.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE)
            return int(port)

    def primary(self) -> RedisProcess:
        """The server the sentinels name as the primary now."""
        port = self.primary_port()
        return next(server for server in self.servers if server.port == port)

    def _ready(self) -> bool:
        """The replica is in sync and every sentinel knows the replica and the other two."""
        if not all(port_open("127.0.0.1", sentinel.port) for sentinel in self.sentinels):
            return False
        try:
            with redis.Redis(port=self.servers[1].port, socket_timeout=2) as replica:
                if replica.info("replication").get("master_link_status") != "up":
                    return False
            for sentinel in self.sentinels:
                with self._sentinel(sentinel) as client:
                    state = client.sentinel_master(SERVICE)
                    if state["num-slaves"] < 1 or state["num-other-sentinels"] < 2:
                        return False
        except redis.RedisError:
            return False
        return True

    @staticmethod
    def _sentinel(sentinel: SentinelProcess) -> redis.Redis:
        return redis.Redis(port=sentinel.port, socket_timeout=2)

    def wait_for_new_primary(self, old_port: int, timeout_s: float = 30.0) -> float:
        """Block until every sentinel names a primary other than ``old_port``; the
        seconds it took."""
        started = time.monotonic()
        while True:
            try:
                ports = set()
                for sentinel in self.sentinels:
                    with self._sentinel(sentinel) as client:
                        addr = client.execute_command(
                            "SENTINEL", "GET-MASTER-ADDR-BY-NAME", SERVICE
                        )
                        ports.add(int(addr[1]))
                if len(ports) == 1 and old_port not in ports:
                    return time.monotonic() - started
            except redis.RedisError:
                pass
            if time.monotonic() - started > timeout_s:
                raise TimeoutError(f"no new primary within {timeout_s:.0f}s")
            time.sleep(0.05)

    def close(self) -> None:
        for sentinel in self.sentinels:
            sentinel.close()
        for server in self.servers:
            server.close()
        self.sentinels = []
        self.servers = []


@contextmanager
def running_sentinel_set(**options: int) -> Iterator[RedisSentinelSet]:
    servers = RedisSentinelSet(**options)
    try:
        yield servers.start()
    finally:
        servers.close()
