"""A real PgBouncer in front of the test PostgreSQL, for tests of SPEC F7 ("works behind
PgBouncer in transaction mode").

:class:`PgBouncerProcess` runs Debian's ``pgbouncer`` binary (``scripts/test`` installs it)
on a free loopback port, forwarding every database name to one PostgreSQL server
(``* = host=… port=…``), so each test's own database is reachable through it by name.
Its pool is smaller than the clients' (``pool_size``), so statements of different client
connections share server sessions: anything that relies on session state (advisory locks,
named prepared statements, ``LISTEN``) breaks visibly, as it does in production.

PgBouncer refuses to run as root; as root the kit runs it as the ``postgres`` user in a
directory that user owns.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from turnstile_testing.processes import free_port, port_open

_WAIT_S = 10.0


def pgbouncer_binary() -> str | None:
    """The ``pgbouncer`` binary, if installed (Debian puts it in /usr/sbin)."""
    return shutil.which("pgbouncer") or next(
        (p for p in ("/usr/sbin/pgbouncer", "/usr/bin/pgbouncer") if os.access(p, os.X_OK)), None
    )


def through(url: str, port: int, host: str = "127.0.0.1") -> str:
    """``url`` with its host and port replaced by PgBouncer's (same user and database)."""
    parts = urlsplit(url)
    user = parts.netloc.rpartition("@")[0]
    netloc = f"{user}@{host}:{port}" if user else f"{host}:{port}"
    return urlunsplit(parts._replace(netloc=netloc))


class PgBouncerProcess:
    """PgBouncer in ``pool_mode`` (default ``transaction``) in front of ``postgres_url``'s
    server, trusting the user of that URL (the test servers use trust auth too)."""

    def __init__(
        self, postgres_url: str, *, pool_mode: str = "transaction", pool_size: int = 4
    ) -> None:
        target = urlsplit(postgres_url)
        self.postgres_url = postgres_url
        self.user = target.username or "postgres"
        self.target_host = target.hostname or "127.0.0.1"
        self.target_port = target.port or 5432
        self.pool_mode = pool_mode
        self.pool_size = pool_size
        self.port = free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="turnstile-pgbouncer-"))
        self._proc: subprocess.Popen[bytes] | None = None

    def url(self, database_url: str | None = None) -> str:
        """``database_url`` (default: the server's maintenance URL) through PgBouncer."""
        return through(database_url or self.postgres_url, self.port)

    @property
    def log(self) -> Path:
        return self.dir / "pgbouncer.log"

    def _config(self) -> Path:
        (self.dir / "users.txt").write_text(f'"{self.user}" ""\n')
        config = self.dir / "pgbouncer.ini"
        config.write_text(
            "\n".join(
                [
                    "[databases]",
                    f"* = host={self.target_host} port={self.target_port}",
                    "[pgbouncer]",
                    "listen_addr = 127.0.0.1",
                    f"listen_port = {self.port}",
                    "unix_socket_dir =",
                    "auth_type = trust",
                    f"auth_file = {self.dir / 'users.txt'}",
                    f"pool_mode = {self.pool_mode}",
                    f"default_pool_size = {self.pool_size}",
                    "max_client_conn = 2000",
                    f"logfile = {self.log}",
                    "log_connections = 0",
                    "log_disconnections = 0",
                    "",
                ]
            )
        )
        return config

    def start(self) -> PgBouncerProcess:
        binary = pgbouncer_binary()
        if binary is None:
            raise RuntimeError("pgbouncer is not installed (scripts/test installs it)")
        config = self._config()
        command = [binary, str(config)]
        if os.geteuid() == 0:
            shutil.chown(self.dir, "postgres", "postgres")
            for path in self.dir.iterdir():
                shutil.chown(path, "postgres", "postgres")
            command = ["runuser", "-u", "postgres", "--", *command]
        self._proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        try:
            self._wait_listening()
        except BaseException:
            self.close()
            raise
        return self

    def _wait_listening(self) -> None:
        deadline = time.monotonic() + _WAIT_S
        while not port_open("127.0.0.1", self.port):
            assert self._proc is not None
            if self._proc.poll() is not None:
                log = self.log.read_text(errors="replace") if self.log.exists() else ""
                raise RuntimeError(f"pgbouncer exited at start: {log[-2000:]}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"pgbouncer did not listen within {_WAIT_S:.0f}s")
            time.sleep(0.05)

    def close(self) -> None:
        """Stop PgBouncer (SIGTERM: fast shutdown) and remove its directory."""
        if self._proc is not None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=10)
            self._proc = None
        shutil.rmtree(self.dir, ignore_errors=True)
