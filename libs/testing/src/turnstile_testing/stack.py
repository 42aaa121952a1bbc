"""The whole local stack (``turnstilectl up``) as a real process on free ports, for the
stack, demo and end-to-end tests."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import grpc.aio

from turnstile_platform import peers
from turnstile_platform.health_check import wait_serving
from turnstile_testing.processes import free_port

#: The ports of a stack started without them, until its ``stack.json`` names them.
UNKNOWN_PORTS = (0, 0, 0)


@dataclass
class RunningStack:
    proc: subprocess.Popen[bytes]
    ports: tuple[int, int, int]
    redis_url: str
    redis_prefix: str
    log: Path
    tls_dir: Path
    tee: subprocess.Popen[bytes] | None = None
    #: Where the stack writes its per-user description (``XDG_STATE_HOME``).
    state_home: Path | None = None
    #: Started with ``--plaintext``: no certificates, no authorization.
    plaintext: bool = False
    #: The terminal the runner runs in (``through_terminal``), until it is closed.
    terminal: _Terminal | None = None

    def tls_env(self) -> dict[str, str]:
        """The stack's CLI certificate (``turnstilectl up`` issues it on start)."""
        return {
            "TURNSTILE_PLAINTEXT": "false",
            "TURNSTILE_TLS_CERT_FILE": str(self.tls_dir / "cli.crt"),
            "TURNSTILE_TLS_KEY_FILE": str(self.tls_dir / "cli.key"),
            "TURNSTILE_TLS_CA_FILE": str(self.tls_dir / "ca.crt"),
        }

    def credentials(self) -> grpc.ChannelCredentials:
        """mTLS client credentials of the stack's CLI identity (an operator)."""
        return grpc.ssl_channel_credentials(
            root_certificates=(self.tls_dir / "ca.crt").read_bytes(),
            private_key=(self.tls_dir / "cli.key").read_bytes(),
            certificate_chain=(self.tls_dir / "cli.crt").read_bytes(),
        )

    def channel(self, address: str, **kwargs: Any) -> grpc.aio.Channel:
        """A channel to one of the stack's services, over mTLS as the operator."""
        return grpc.aio.secure_channel(address, self.credentials(), **kwargs)

    @property
    def addresses(self) -> tuple[str, str, str]:
        return tuple(f"127.0.0.1:{p}" for p in self.ports)  # type: ignore[return-value]

    def env(self) -> dict[str, str]:
        """The environment a CLI command needs to talk to this stack."""
        admission, substrate, affinity = self.addresses
        return {
            **os.environ,
            "TURNSTILE_ADMISSION_ADDR": admission,
            "TURNSTILE_SUBSTRATE_ADDR": substrate,
            "TURNSTILE_AFFINITY_ADDR": affinity,
            "TURNSTILE_REDIS_URL": self.redis_url,
            "TURNSTILE_REDIS_PREFIX": self.redis_prefix,
            **({"XDG_STATE_HOME": str(self.state_home)} if self.state_home else {}),
            **self.tls_env(),
        }

    async def wait_serving(self, timeout_s: float = 45.0) -> None:
        if self.ports == UNKNOWN_PORTS:  # the stack picks them: its stack.json says
            self.ports = await self._described_ports(timeout_s)
        if self.plaintext:  # no certificates to wait for
            await self._wait_answering(None, timeout_s)
            return
        services = (peers.ADMISSION, peers.SUBSTRATE, peers.AFFINITY)
        # The certificates exist once the runner's preflight has issued them.
        for _ in range(int(timeout_s / 0.05)):
            # Each file is written on its own (atomically): wait for all three.
            issued = all((self.tls_dir / f).exists() for f in ("ca.crt", "cli.crt", "cli.key"))
            if issued or self.proc.poll() is not None:
                break
            await asyncio.sleep(0.05)
        credentials = self.credentials()
        await self._wait_answering(credentials, timeout_s, services)

    async def _wait_answering(
        self,
        credentials: grpc.ChannelCredentials | None,
        timeout_s: float,
        services: tuple[str, str, str] = (peers.ADMISSION, peers.SUBSTRATE, peers.AFFINITY),
    ) -> None:
        results = await asyncio.gather(
            *(
                wait_serving(a, timeout_s=timeout_s, service=s, credentials=credentials)
                for a, s in zip(self.addresses, services, strict=True)
            )
        )
        if not all(results) or self.proc.poll() is not None:
            raise AssertionError(f"stack did not come up:\n{self.output()}")
        # The runner prints its banner once it has seen every service SERVING.
        for _ in range(int(timeout_s / 0.05)):
            if "Turnstile is up" in self.output():
                return
            await asyncio.sleep(0.05)
        raise AssertionError(f"no banner:\n{self.output()}")

    async def _described_ports(self, timeout_s: float) -> tuple[int, int, int]:
        import json

        described = self.log.with_name("stack.json")
        for _ in range(int(timeout_s / 0.05)):
            try:
                addresses = json.loads(described.read_text())["addresses"]
                a, s, f = (
                    int(addresses[name].rsplit(":", 1)[1])
                    for name in ("admission", "substrate", "affinity")
                )
                return a, s, f
            except (OSError, ValueError, KeyError):
                if self.proc.poll() is not None:
                    break
                await asyncio.sleep(0.05)
        raise AssertionError(f"no stack.json naming the ports:\n{self.output()}")

    def interrupt(self, timeout_s: float = 60.0) -> int:
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=timeout_s)

    def ctrl_c_through_tee(self, timeout_s: float = 60.0) -> int:
        """Ctrl-C on ``up | tee``: the terminal interrupts the whole pipeline, so
        ``tee`` dies at once while the runner starts to stop, its output's reader
        gone. Returns the runner's exit code."""
        assert self.tee is not None, "run_stack(through_tee=True)"
        self.tee.send_signal(signal.SIGINT)
        self.tee.wait(timeout=10)
        self.proc.send_signal(signal.SIGINT)
        return self.proc.wait(timeout=timeout_s)

    def ctrl_c_in_terminal(self, timeout_s: float = 60.0) -> int:
        """Ctrl-C in the terminal of ``up 2>&1 | tee`` (``tee_in_terminal``): SIGINT
        to the terminal's foreground process group, the shell, the runner and
        ``tee`` alike. Returns the shell's exit code once the pipeline is over."""
        os.killpg(self.proc.pid, signal.SIGINT)
        return self.proc.wait(timeout=timeout_s)

    def close_terminal(self) -> None:
        """Close the terminal window the runner runs in (``through_terminal``): the
        kernel hangs up its controlling terminal, sending it SIGHUP, and every
        later write of the runner to it fails."""
        assert self.terminal is not None, "run_stack(through_terminal=True)"
        self.terminal.close()

    def output(self) -> str:
        return self.log.read_text(errors="replace")


class _Terminal:
    """A pseudo-terminal whose screen is copied to a log, like a terminal window."""

    def __init__(self, log: Path) -> None:
        import pty
        import threading

        self.master, self.slave = pty.openpty()
        self._closing = threading.Event()
        self._copier = threading.Thread(target=self._copy, args=(log,), daemon=True)
        self._copier.start()

    def _copy(self, log: Path) -> None:
        import select

        with log.open("ab") as out:
            while not self._closing.is_set():
                ready, _, _ = select.select([self.master], [], [], 0.05)
                if not ready:
                    continue
                try:
                    data = os.read(self.master, 65536)
                except OSError:  # EIO: nothing holds the other side any more
                    return
                if not data:
                    return
                out.write(data)
                out.flush()

    def close(self) -> None:
        """Stop reading and close the master side: the terminal is gone."""
        self._closing.set()
        self._copier.join(5)
        if self.master >= 0:  # once: a closed fd's number may be reused
            os.close(self.master)
            self.master = -1


def _take_terminal() -> None:  # pragma: no cover - runs in the child before exec
    """Make stdin (a terminal) the controlling terminal of this new session."""
    import fcntl
    import termios

    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


@contextmanager
def run_stack(
    tmp_path: Path,
    *,
    redis_url: str,
    redis_prefix: str,
    database_url: str,
    grace_s: float = 10.0,
    extra_env: dict[str, str] | None = None,
    metrics_ports: tuple[int, int, int] = (0, 0, 0),
    prometheus_port: int = 0,
    through_tee: bool = False,
    plaintext: bool = False,
    pick_ports: bool = False,
    through_terminal: bool = False,
    under_script: bool = False,
    tee_in_terminal: bool = False,
) -> Iterator[RunningStack]:
    """Run ``turnstilectl up`` on free gRPC ports; metrics endpoints and the local
    Prometheus stay off unless ports are given for them. ``through_tee`` pipes
    the runner's output through a real ``tee`` (``./scripts/up | tee up.log``):
    :meth:`RunningStack.ctrl_c_through_tee` then stops both as a terminal's
    Ctrl-C does. ``plaintext`` starts it with ``--plaintext``. ``pick_ports`` gives no gRPC ports,
    so the stack starts from the defaults and moves those taken; its ``stack.json``
    then names them (:meth:`RunningStack.wait_serving` reads them there).
    ``through_terminal`` runs it in a terminal of its own (a pseudo-terminal, its
    controlling one) whose screen goes to the log: :meth:`RunningStack.close_terminal`
    closes it as a person closes the window. ``under_script`` starts it as
    ``./scripts/up`` does, in the background of a shell that waits for it and names
    itself in ``TURNSTILE_STOP_WITH_PARENT``: ``proc`` is then that shell.
    ``tee_in_terminal`` is a person's ``turnstilectl up 2>&1 | tee tee.log`` in a
    terminal (a pseudo-terminal whose screen goes to the log): one shell runs the
    pipeline as the terminal's session, so a Ctrl-C
    (:meth:`RunningStack.ctrl_c_in_terminal`) reaches every process in it and
    ``tee`` dies with the runner's output's only reader; ``proc`` is that shell."""
    ports = UNKNOWN_PORTS if pick_ports else (free_port(), free_port(), free_port())
    log = tmp_path / "stack.log"
    env = {
        key: value
        for key, value in os.environ.items()
        if not key.startswith(("TURNSTILE_", "OTEL_"))
    }
    # The stack's per-user description (turnstilectl's stack.json) goes under the
    # test's own directory, never the user's.
    env.update(
        {
            "TURNSTILE_SHUTDOWN_GRACE_S": "3",
            "XDG_STATE_HOME": str(tmp_path / "xdg-state"),
            **(extra_env or {}),
        }
    )
    tee = (
        subprocess.Popen(
            ["tee", str(log)],
            stdin=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        if through_tee
        else None
    )
    terminal = _Terminal(log) if through_terminal or tee_in_terminal else None
    with log.open("ab") as out:
        if terminal is not None:
            output: Any = terminal.slave
        else:
            output = out if tee is None else tee.stdin
        script = ["bash", "-c", 'TURNSTILE_STOP_WITH_PARENT=$$ "$@" & wait', "up"]
        if tee_in_terminal:
            script = ["bash", "-c", '"$@" 2>&1 | tee "$0"', str(tmp_path / "tee.log")]
        proc = subprocess.Popen(
            [
                *(script if under_script or tee_in_terminal else []),
                sys.executable,
                "-m",
                "turnstile_cli",
                "up",
                *([] if pick_ports else ["--grpc-ports", ",".join(map(str, ports))]),
                "--metrics-ports",
                ",".join(map(str, metrics_ports)),
                "--prometheus-port",
                str(prometheus_port),
                "--prometheus-scrape-interval",
                "1",
                "--redis-url",
                redis_url,
                "--redis-prefix",
                redis_prefix,
                "--database-url",
                database_url,
                "--state-dir",
                str(tmp_path / "direct"),
                "--tls-dir",
                str(tmp_path / "tls"),
                "--grace",
                str(grace_s),
                "--stop-grace",
                "10",
                *(["--plaintext"] if plaintext else []),
            ],
            stdin=terminal.slave if terminal is not None else None,
            stdout=output,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
            preexec_fn=_take_terminal if terminal is not None else None,
        )
    if terminal is not None:
        os.close(terminal.slave)  # the runner holds the terminal's only other side
    if tee is not None and tee.stdin is not None:
        tee.stdin.close()  # the runner holds the pipe's only write end
    stack = RunningStack(
        proc,
        ports,
        redis_url,
        redis_prefix,
        log,
        tmp_path / "tls",
        tee,
        tmp_path / "xdg-state",
        plaintext,
        terminal,
    )
    try:
        yield stack
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        if tee is not None and tee.poll() is None:
            tee.kill()
            tee.wait()
        if terminal is not None:
            terminal.close()
