"""Real Redis and PostgreSQL servers started by the test kit.

Used in two ways: as the last resort when nothing answers at the configured
URLs (a fresh machine), and as *private* servers for fault tests that stop and
restart them, so a test never stops the shared server other tests use.

PostgreSQL refuses to run as root, so when the kit runs as root it runs
``initdb``/``pg_ctl`` as the ``postgres`` user in a directory that user owns.
"""

from __future__ import annotations

import contextlib
import os
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

_handed_out: set[int] = set()


#: How many ports below the kernel's ephemeral range :func:`free_port` draws from.
_OWN_PORTS = 12_000


def ephemeral_port_range() -> tuple[int, int]:
    """The ports the kernel gives outgoing connections their local end from."""
    try:
        low, high = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()
        return int(low), int(high)
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on right now, never one this process
    handed out before, and outside the kernel's ephemeral range.

    The port is free when returned, not reserved: the kernel may offer the same
    port to two calls in a row once the first probe socket is closed, and two
    services of one stack told to share a port would split its connections. And
    a port from the ephemeral range (what binding port 0 gives) can be taken, in
    the moment before the server binds it, as the local end of any outgoing
    connection on the machine (a test's Redis client, another suite running
    alongside): the server then fails to bind (seen on a loaded machine). So the
    port is drawn at random from the ports just below that range, which the kernel
    never hands to outgoing connections."""
    low, _ = ephemeral_port_range()
    start = max(1024, low - _OWN_PORTS)
    for _ in range(1000):
        if start < low:
            port = random.randrange(start, low)
            if port in _handed_out or not _bindable(port):
                continue
        else:  # no room below the range: let the kernel choose
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
            if port in _handed_out:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no fresh free port on 127.0.0.1")


def port_open(host: str, port: int, timeout: float = 0.3) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def _wait_for(predicate: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise TimeoutError(f"{what} did not come up within {timeout:.0f}s")


class RedisProcess:
    """A redis-server on its own port and directory, with nothing persisted."""

    def __init__(self, port: int | None = None, *, options: Sequence[str] = ()) -> None:
        self.port = port or free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="turnstile-redis-"))
        #: More ``redis-server`` options (e.g. ``--cluster-enabled yes``).
        self.options = tuple(options)
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int:
        """The server's process id (benchmarks read its CPU time)."""
        if self._proc is None:
            raise RuntimeError("redis-server is not started")
        return self._proc.pid

    def start(self) -> RedisProcess:
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (scripts/test installs it)")
        self._proc = subprocess.Popen(
            [
                binary,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.dir),
                "--loglevel",
                "warning",
                *self.options,
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        _wait_for(lambda: port_open("127.0.0.1", self.port), 10, "redis-server")
        return self

    def pause(self) -> None:
        """SIGSTOP the server: its socket still accepts, nothing answers (a hung Redis)."""
        if self._proc is not None:
            self._proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self._proc is not None:
            self._proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        """Stop abruptly (SIGKILL): what a crash looks like to clients."""
        if self._proc is not None:
            self.resume()
            self._proc.kill()
            self._proc.wait(timeout=10)
            self._proc = None

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.dir, ignore_errors=True)


class PostgresProcess:
    """A private PostgreSQL cluster (trust auth, user ``postgres``)."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.base = Path(tempfile.mkdtemp(prefix="turnstile-pg-"))
        self.data = self.base / "data"
        self._as_postgres = os.geteuid() == 0
        self._initialised = False

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def _run(self, *args: str) -> None:
        command = list(args)
        if self._as_postgres:
            command = ["runuser", "-u", "postgres", "--", *command]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    def _binary(self, name: str) -> str:
        found = shutil.which(name)
        if found:
            return found
        for candidate in sorted(Path("/usr/lib/postgresql").glob(f"*/bin/{name}"), reverse=True):
            return str(candidate)
        raise RuntimeError(f"{name} is not installed (scripts/test installs PostgreSQL)")

    def _initialise(self) -> None:
        """Create the data directory (a new cluster; a standby copies its primary's)."""
        self._run(
            self._binary("initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
            "-E",
            "UTF8",
        )

    def start(self) -> PostgresProcess:
        if self._as_postgres:
            shutil.chown(self.base, "postgres", "postgres")
        if not self._initialised:
            self._initialise()
            self._initialised = True
        self._run(
            self._binary("pg_ctl"),
            "-D",
            str(self.data),
            "-w",
            "-t",
            "30",
            "-l",
            str(self.base / "log"),
            "-o",
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off",
            "start",
        )
        return self

    def query(self, sql: str) -> str:
        """The text of ``sql``'s result (psql over TCP with trust auth; no event loop needed)."""
        done = subprocess.run(
            [
                self._binary("psql"),
                "-h",
                "127.0.0.1",
                "-p",
                str(self.port),
                "-U",
                "postgres",
                "-d",
                "postgres",
                "-Atc",
                sql,
            ],
            check=True,
            capture_output=True,
            text=True,
        )
        return done.stdout.strip()

    def _pids(self) -> list[int]:
        """The postmaster and every process it started (one backend per connection)."""
        pid_file = self.data / "postmaster.pid"
        if not pid_file.exists():
            return []
        postmaster = int(pid_file.read_text().split()[0])
        children = []
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == postmaster:
                children.append(int(stat.parent.name))
        return [postmaster, *children]

    def pause(self) -> None:
        """SIGSTOP the postmaster and its backends: sockets accept, nothing answers."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGSTOP)

    def resume(self) -> None:
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)

    def kill(self) -> None:
        """SIGKILL the postmaster and every backend: a crash (the machine or container
        gone), with no shutdown checkpoint and no WAL handed to a standby. The stale pid
        file goes too, as on a machine that is gone: nothing is left to stop."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        (self.data / "postmaster.pid").unlink(missing_ok=True)

    def stop(self, mode: str = "immediate") -> None:
        """Stop (``immediate`` is what a crash looks like to clients)."""
        self.resume()
        if self._initialised and (self.data / "postmaster.pid").exists():
            self._run(self._binary("pg_ctl"), "-D", str(self.data), "-m", mode, "-w", "stop")

    def close(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)
