"""A real Redis Cluster on loopback ports, for tests that must see what a cluster
refuses (a script touching a key of another slot, a node that does not own a
key's slot) and for running the services against a cluster.

``redis-server --cluster-enabled yes`` on each port, then ``redis-cli --cluster
create`` assigns the 16,384 slots over the masters (about a second here, see
``docs/scaling.md``). Nothing is persisted; :meth:`RedisClusterServers.close` kills the
servers and removes their directories.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager

import redis

from turnstile_testing.processes import RedisProcess, free_port


class RedisClusterServers:
    """``masters`` masters with ``replicas`` replicas each, every slot assigned."""

    def __init__(self, masters: int = 3, replicas: int = 0) -> None:
        if masters < 3:
            raise ValueError("redis-cli --cluster create needs at least 3 masters")
        self.masters = masters
        self.replicas = replicas
        self.nodes: list[RedisProcess] = []

    @property
    def url(self) -> str:
        """A seed URL (the first node): redis-py's ``RedisCluster.from_url`` finds the rest."""
        return f"redis://127.0.0.1:{self.nodes[0].port}"

    @property
    def seeds_url(self) -> str:
        """The ``redis+cluster://`` URL Turnstile's settings take (every node a seed)."""
        return "redis+cluster://" + ",".join(f"127.0.0.1:{port}" for port in self.ports)

    @property
    def ports(self) -> list[int]:
        return [node.port for node in self.nodes]

    def node(self, port: int) -> RedisProcess:
        """The server on ``port`` (to pause or stop it)."""
        return next(node for node in self.nodes if node.port == port)

    def master_of(self, slot: int) -> int:
        """The port of the master serving ``slot`` now."""
        with redis.Redis(port=self.ports[0], host="127.0.0.1", socket_timeout=2) as client:
            for start, end, master, *_ in client.execute_command("CLUSTER", "SLOTS"):
                if start <= slot <= end:
                    return int(master[1])
        raise LookupError(f"slot {slot} is not served")

    def failover(self, replica_port: int, timeout_s: float = 30.0) -> float:
        """``CLUSTER FAILOVER`` on the replica on ``replica_port`` (a coordinated
        hand-over, no write lost); the seconds until it is a master."""
        started = time.monotonic()
        with redis.Redis(port=replica_port, host="127.0.0.1", socket_timeout=2) as client:
            client.execute_command("CLUSTER", "FAILOVER")
        self.wait_until_master(replica_port, timeout_s)
        return time.monotonic() - started

    def wait_until_master(self, port: int, timeout_s: float = 30.0) -> float:
        """Block until the node on ``port`` is a master; the seconds it took."""
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            try:
                with redis.Redis(port=port, host="127.0.0.1", socket_timeout=1) as client:
                    if client.info("replication")["role"] == "master":
                        return time.monotonic() - started
            except redis.RedisError:
                pass
            time.sleep(0.01)
        raise TimeoutError(f"127.0.0.1:{port} did not become a master in {timeout_s:.0f} s")

    def replica_of(self, master_port: int) -> int:
        """The port of a replica of the master on ``master_port``, in sync with it."""
        for port in self.ports:
            with redis.Redis(port=port, host="127.0.0.1", socket_timeout=2) as client:
                info = client.info("replication")
            if info["role"] == "slave" and info["master_port"] == master_port:
                return port
        raise LookupError(f"no replica of 127.0.0.1:{master_port}")

    def start(self, timeout_s: float = 30.0) -> RedisClusterServers:
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed (scripts/test installs redis-tools)")
        for _ in range(self.masters * (1 + self.replicas)):
            # The bus port is chosen too: the default (port + 10,000) is past
            # 65,535 for half the ephemeral ports free_port() hands out.
            node = RedisProcess(
                options=(
                    "--cluster-enabled",
                    "yes",
                    "--cluster-port",
                    str(free_port()),
                    "--cluster-config-file",
                    "nodes.conf",
                    "--cluster-node-timeout",
                    "2000",
                )
            )
            self.nodes.append(node.start())
        subprocess.run(
            [
                cli,
                "--cluster",
                "create",
                *(f"127.0.0.1:{port}" for port in self.ports),
                "--cluster-replicas",
                str(self.replicas),
                "--cluster-yes",
            ],
            check=True,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            timeout=timeout_s,
        )
        self._wait_until_ok(timeout_s)
        return self

    def _wait_until_ok(self, timeout_s: float) -> None:
        """Every node says ``cluster_state:ok`` and knows every other node."""
        deadline = time.monotonic() + timeout_s
        while True:
            if all(self._node_ready(port) for port in self.ports):
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"Redis Cluster on {self.ports} not ready in {timeout_s:.0f}s")
            time.sleep(0.05)

    def _node_ready(self, port: int) -> bool:
        """The node sees the whole cluster; a replica has finished its first sync
        (a ``CLUSTER FAILOVER`` before that never completes)."""
        with redis.Redis(port=port, host="127.0.0.1", socket_timeout=2) as client:
            info = client.execute_command("CLUSTER", "INFO")
            text = info.decode() if isinstance(info, bytes) else str(info)
            fields = dict(line.split(":", 1) for line in text.split() if ":" in line)
            replication = client.info("replication")
            return (
                fields.get("cluster_state") == "ok"
                and int(fields.get("cluster_known_nodes", 0)) == len(self.nodes)
                and int(fields.get("cluster_slots_ok", 0)) == 16384
                and (
                    replication["role"] == "master" or replication.get("master_link_status") == "up"
                )
            )

    def close(self) -> None:
        for node in self.nodes:
            node.close()
        self.nodes = []


@contextmanager
def running_cluster(masters: int = 3, replicas: int = 0) -> Iterator[RedisClusterServers]:
    servers = RedisClusterServers(masters, replicas)
    try:
        yield servers.start()
    finally:
        servers.close()
