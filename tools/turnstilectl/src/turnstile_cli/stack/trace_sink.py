"""Where the local stack's spans go, so that a trace can be seen without Docker.

In order: nowhere with ``OTEL_TRACES_EXPORTER=none``; the collector your
``OTEL_EXPORTER_OTLP_ENDPOINT`` (or ``_TRACES_``) names, untouched; else a Jaeger
(v2) the stack runs when a ``jaeger`` binary is on ``PATH`` (Jaeger's release
archives hold one), in memory, on loopback, with a configuration of the stack's
own (free ports when the defaults are taken); else the stack's own OTLP receiver
(:mod:`.otlp_receiver`), read by ``turnstilectl traces``. The services get the
endpoint and a short batch delay, so a trace is there within a second of the call.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

from turnstile_cli.stack import procs
from turnstile_cli.stack.preflight import port_free

#: Jaeger's default ports: OTLP/gRPC and its UI.
OTLP_PORT = 4317
JAEGER_UI_PORT = 16686

#: How long the stack's own receiver gets to bind its port.
RECEIVER_START_S = 10.0
#: How long a starting Jaeger gets to accept OTLP connections.
JAEGER_START_S = 20.0

#: The services' batch delay (the SDK's default is 5 s): a trace shows at once.
BATCH_DELAY_MS = "500"

_JAEGER_CONFIG = """\
# Written by turnstilectl up: Jaeger v2, in memory, on loopback.
service:
  extensions: [jaeger_storage, jaeger_query]
  pipelines:
    traces:
      receivers: [otlp]
      processors: [batch]
      exporters: [jaeger_storage_exporter]
  telemetry:
    metrics:
      level: none
extensions:
  jaeger_query:
    storage:
      traces: memory_store
    http:
      endpoint: 127.0.0.1:{ui_port}
    grpc:
      endpoint: 127.0.0.1:{query_port}
  jaeger_storage:
    backends:
      memory_store:
        memory:
          max_traces: 100000
receivers:
  otlp:
    protocols:
      grpc:
        endpoint: 127.0.0.1:{otlp_port}
processors:
  batch:
exporters:
  jaeger_storage_exporter:
    trace_storage: memory_store
"""


def your_endpoint(environ: Mapping[str, str] = os.environ) -> str:
    """The collector the environment names ("" when none)."""
    return environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get(
        "OTEL_EXPORTER_OTLP_ENDPOINT", ""
    )


def _port(preferred: int, avoid: set[int]) -> int:
    if preferred not in avoid and port_free(preferred):
        return preferred
    import socket

    while True:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port


async def _accepts(port: int) -> bool:
    try:
        _, writer = await asyncio.wait_for(asyncio.open_connection("127.0.0.1", port), 1.0)
    except (OSError, TimeoutError):
        return False
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True


@dataclass
class TraceSink:
    """The stack's choice, and what it started for it."""

    kind: str  # "off", "yours", "jaeger" or "receiver"
    endpoint: str
    directory: Path
    ui: str = ""
    receiver: asyncio.subprocess.Process | None = None
    jaeger: asyncio.subprocess.Process | None = None
    notes: list[str] = field(default_factory=list)

    @classmethod
    async def start(cls, directory: Path) -> TraceSink:
        """Pick and start where spans go; ``directory`` holds the receiver's span log
        or Jaeger's configuration and log."""
        if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "none":
            return cls("off", "", directory)
        if your_endpoint():
            return cls("yours", your_endpoint(), directory)
        notes: list[str] = []
        binary = shutil.which("jaeger")
        if binary is not None:
            sink = await cls._start_jaeger(binary, directory, notes)
            if sink is not None:
                return sink
        started = await _start_receiver(directory, _port(OTLP_PORT, set()))
        if started is None:
            started = await _start_receiver(directory, 0)
        if started is None:
            notes.append("the stack's OTLP receiver did not start: spans are not kept")
            return cls("off", "", directory, notes=notes)
        proc, port = started
        endpoint = f"http://127.0.0.1:{port}"
        return cls("receiver", endpoint, directory, receiver=proc, notes=notes)

    @classmethod
    async def _start_jaeger(
        cls, binary: str, directory: Path, notes: list[str]
    ) -> TraceSink | None:
        otlp = _port(OTLP_PORT, set())
        ui = _port(JAEGER_UI_PORT, {otlp})
        query = _port(16685, {otlp, ui})
        config = _write_config(directory, ui_port=ui, query_port=query, otlp_port=otlp)
        log = directory / "jaeger.log"
        with log.open("wb") as out:
            proc = await asyncio.create_subprocess_exec(
                binary,
                "--config",
                str(config),
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=procs.die_with_parent,
            )
        loop = asyncio.get_running_loop()
        deadline = loop.time() + JAEGER_START_S
        while loop.time() < deadline and proc.returncode is None:
            if await _accepts(otlp):
                return cls(
                    "jaeger",
                    f"http://127.0.0.1:{otlp}",
                    directory,
                    ui=f"http://127.0.0.1:{ui}",
                    jaeger=proc,
                    notes=notes,
                )
            await asyncio.sleep(0.1)
        notes.append(f"{binary} did not start (see {log}): using the stack's own receiver")
        await _stop_group(proc)
        return None

    def environment(self) -> dict[str, str]:
        """What the services need to export here (nothing when it is yours)."""
        if self.kind in ("yours", "off"):
            return {}
        return {
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_EXPORTER_OTLP_INSECURE": "true",
            "OTEL_BSP_SCHEDULE_DELAY": os.environ.get("OTEL_BSP_SCHEDULE_DELAY", BATCH_DELAY_MS),
        }

    def description(self) -> dict[str, Any]:
        """For ``stack.json``: ``turnstilectl traces`` reads it."""
        out: dict[str, Any] = {"kind": self.kind, "endpoint": self.endpoint}
        if self.kind == "receiver":
            out["dir"] = str(self.directory.absolute())
        if self.ui:
            out["ui"] = self.ui
        return out

    def summary(self) -> str:
        """The banner's line."""
        if self.kind == "off":
            return "not exported (OTEL_TRACES_EXPORTER=none)"
        if self.kind == "yours":
            return f"OTLP → {self.endpoint} (your OTEL_EXPORTER_OTLP_ENDPOINT)"
        if self.kind == "jaeger":
            return f"Jaeger UI {self.ui} (OTLP {self.endpoint})"
        return f"turnstilectl traces (the stack's OTLP receiver on {self.endpoint})"

    @property
    def pid(self) -> int | None:
        """The process the stack started for its spans (Jaeger or the receiver)."""
        proc = self.jaeger or self.receiver
        return proc.pid if proc is not None else None

    async def stop(self) -> None:
        if self.receiver is not None:
            await _stop_group(self.receiver)
        if self.jaeger is not None:
            await _stop_group(self.jaeger)


async def _start_receiver(
    directory: Path, port: int
) -> tuple[asyncio.subprocess.Process, int] | None:
    """The OTLP receiver started in a process of its own (:mod:`.otlp_receiver` says
    why), and the port it bound; None when it could not bind ``port``."""
    with _receiver_log(directory) as log:
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "turnstile_cli.stack.otlp_receiver",
            str(directory),
            str(port),
            str(os.getpid()),
            stdin=asyncio.subprocess.DEVNULL,
            stdout=asyncio.subprocess.PIPE,
            stderr=log,
            start_new_session=True,
        )
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), RECEIVER_START_S)
    except TimeoutError:
        line = b""
    bound = int(line.strip() or 0)
    if bound == 0:
        await _stop_group(proc)
        return None
    return proc, bound


def _receiver_log(directory: Path) -> BinaryIO:
    """Where the receiver's own errors go (its stdout only says its port)."""
    directory.mkdir(parents=True, exist_ok=True)
    return (directory / "receiver.log").open("ab")


def _write_config(directory: Path, **ports: int) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "jaeger.yaml"
    config.write_text(_JAEGER_CONFIG.format(**ports))
    return config


async def _stop_group(proc: asyncio.subprocess.Process, grace_s: float = 5.0) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace_s)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
