"""Run the local stack in the foreground until Ctrl-C, SIGTERM or SIGHUP (the
terminal closed), then stop it all.

Start: preflight (stopped sandboxes' old state directories pruned, tiers,
commands, ports, Redis, PostgreSQL, migrations), then
the three services, each the leader of its own session and process group, and
each waited for until gRPC health says SERVING.

Stop, in an order that leaves nothing behind:

1. the substrate deactivates every running sandbox (the Direct substrate does
   not stop runtimes when it exits: they outlive restarts by design); each
   worker says goodbye, which also ends its relay stream;
2. affinity gets SIGTERM, then substrate and admission; any group still there
   after the grace gets SIGKILL;
3. whatever is still below the runner (a runtime whose substrate died: the
   runner is a child subreaper, so it inherited it) gets SIGTERM, then SIGKILL.

A runner killed outright does none of this: its services get SIGTERM from the
kernel (``PR_SET_PDEATHSIG``), and its guard (:mod:`.guard`, a process of its own
that sees the runner go) stops the runtimes and whatever else ``stack.json``
recorded; should the guard be gone too, the next ``up`` does it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
from dataclasses import dataclass, replace
from pathlib import Path
from typing import IO, cast

import grpc
import grpc.aio
from rich.console import Console
from rich.table import Table

from turnstile_cli.stack import guard, procs, prometheus, state
from turnstile_cli.stack.config import (
    HOLDERS,
    SERVERS,
    TRUST_DOMAIN,
    ServiceSpec,
    StackConfig,
    find_command,
)
from turnstile_cli.stack.logs import LogPrinter
from turnstile_cli.stack.policy_file import PolicyFileError, ensure_policy
from turnstile_cli.stack.preflight import (
    PreflightError,
    check_commands,
    check_ports,
    check_redis,
    check_tiers,
    ensure_database,
    migrate,
    redacted,
    settle_ports,
)
from turnstile_cli.stack.runtime_user import runtime_user_env
from turnstile_cli.stack.terminal import DetachingOutput
from turnstile_cli.stack.trace_sink import TraceSink
from turnstile_contracts import substrate_pb2, substrate_pb2_grpc
from turnstile_platform import peers
from turnstile_platform.health_check import wait_serving
from turnstile_platform.pki import ensure_local_pki
from turnstile_platform.sandbox_credentials import generate_key_pair
from turnstile_platform.tiers import parse_tiers
from turnstile_platform.tls import TlsFiles, channel_credentials, server_check_options

#: The service each process must serve: asking health about it (not the server as
#: a whole) tells the runner the right service answers on the port it was given.
SERVICE_NAMES = {
    "admission": peers.ADMISSION,
    "substrate": peers.SUBSTRATE,
    "affinity": peers.AFFINITY,
}


@dataclass
class Running:
    spec: ServiceSpec
    proc: asyncio.subprocess.Process
    pump: asyncio.Task[None]

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    def signal_group(self, sig: signal.Signals) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, sig)


class Stack:
    def __init__(
        self,
        config: StackConfig,
        console: Console,
        *,
        startup_timeout_s: float = 60.0,
        stop_grace_s: float = 15.0,
        prune_after_s: float = 24 * 3600,
    ) -> None:
        self.config = config
        self.console = console
        #: Where the runner's output goes once nobody reads it (a closed terminal,
        #: a dead ``| tee``): the stop goes on and is told there.
        self.output = DetachingOutput(
            console.file, state.path_for(config.state_dir).with_name("stop.log")
        )
        # A stand-in for the stream it wraps (write, flush, the rest delegated).
        console.file = cast("IO[str]", self.output)
        self.printer = LogPrinter(console)
        self.startup_timeout_s = startup_timeout_s
        self.stop_grace_s = stop_grace_s
        self.prune_after_s = prune_after_s
        self.running: dict[str, Running] = {}
        self.prometheus: prometheus.LocalPrometheus | None = None
        self.prometheus_note = "not installed (Debian's prometheus package)"
        #: Who the substrate's runtimes run as (SPEC O4), chosen at preflight.
        self.runtime_user_env: dict[str, str] = {}
        #: The guard process and its pipe (:mod:`.guard`), once the stack is described.
        self.guard: tuple[subprocess.Popen[bytes], int] | None = None
        #: Where the services' spans go (:mod:`.trace_sink`), chosen at preflight.
        self.traces: TraceSink | None = None
        #: What the stack said since its stop began (None until then): the summary
        #: :meth:`tell_stop` repeats on the terminal.
        self.stop_lines: list[str] | None = None

    def say(self, text: str) -> None:
        self.printer.line("stack", text)
        if self.stop_lines is not None:
            self.stop_lines.append(text)

    def tell_stop(self) -> None:
        """After a stop whose output lost its reader (``| tee`` killed by the same
        Ctrl-C), repeat what the stop said on the terminal, with where the rest is."""
        if not self.output.reader_lost or not self.stop_lines:
            return
        self.output.tell_terminal(
            [f"turnstile stack: {line}" for line in self.stop_lines]
            + [f"turnstile stack: (everything the stop printed is in {self.output.log})"]
        )

    async def run(self) -> int:
        """Start, serve until a signal or a service dies, stop. Returns the exit code."""
        loop = asyncio.get_running_loop()
        stop = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        loop.add_signal_handler(signal.SIGHUP, self.hang_up, stop)
        try:
            if not self.stop_with_parent():
                self.say("the script that started the stack is gone: not starting")
                return 1
            try:
                await self.preflight()
            except PreflightError as error:
                self.console.print(f"[bold red]cannot start the stack:[/] {error}")
                return 1
            if not procs.become_subreaper():
                self.say("could not become a subreaper: orphaned runtimes may survive a crash")
            if not await self.start(stop):
                self.stop_lines = []
                await self.stop()
                self.tell_stop()
                return 1
            self.describe()  # from here a killed runner leaves a list of what to stop
            # ... and its guard stops what is on it, should the runner be killed.
            self.guard = guard.start(self.config.state_dir)
            if self.guard is None:
                self.say("could not start the guard: if killed, the next `up` stops what is left")
            await self.start_prometheus()
            # stack.json first: whoever sees the banner may read it at once.
            self.describe()
            self.banner()
            died = await self.wait_for_stop_or_death(stop)
            self.stop_lines = []
            if died is not None:
                self.say(f"{died} exited unexpectedly (exit {self.running[died].proc.returncode})")
            await self.stop()
            self.tell_stop()
            return 1 if died is not None else 0
        finally:
            for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
                loop.remove_signal_handler(sig)

    @staticmethod
    def stop_with_parent() -> bool:
        """``./scripts/up`` runs the runner in the background of its shell and sets
        ``TURNSTILE_STOP_WITH_PARENT`` to that shell's pid: should the script be
        killed outright, the runner gets SIGTERM (``PR_SET_PDEATHSIG``) and stops
        as on Ctrl-C, instead of running on where no Ctrl-C reaches it. False when
        that shell is gone already (before the signal could be asked for)."""
        parent = os.environ.pop("TURNSTILE_STOP_WITH_PARENT", "")
        if not parent.isdigit():
            return True
        procs.die_with_parent()
        return os.getppid() == int(parent)

    def prepare_tls(self) -> None:
        """Issue the local CA and certificates on first start (kept afterwards) and
        keep the local policy current: written when there is none or it is an earlier
        version's default, checked when it was edited (:mod:`.policy_file`)."""
        config = self.config
        if config.tls_dir is None:
            self.say("plaintext on loopback: no certificates, no authorization")
            return
        ensure_local_pki(config.tls_dir, TRUST_DOMAIN, HOLDERS, servers=SERVERS)
        try:
            note = ensure_policy(config.tls_dir)
        except PolicyFileError as error:
            raise PreflightError(str(error)) from None
        if note:
            self.say(note)
        self.say(f"mTLS: CA and certificates in {config.tls_dir}")

    def credentials(self) -> grpc.ChannelCredentials | None:
        """The CLI certificate, for the runner's own health checks and calls."""
        config = self.config
        if config.tls_dir is None:
            return None
        files = TlsFiles(
            Path(config.tls_file("cli.crt")),
            Path(config.tls_file("cli.key")),
            Path(config.tls_file("ca.crt")),
        )
        return channel_credentials(files)

    def server_options(self, service: str) -> list[tuple[str, str]]:
        """The channel arguments that check ``service`` holds its own SPIFFE ID (SPEC O5)."""
        if self.config.tls_dir is None:
            return []
        return server_check_options(f"spiffe://{TRUST_DOMAIN}/{HOLDERS[service]}")

    def hang_up(self, stop: asyncio.Event) -> None:
        """The terminal closed (SIGHUP): stop as Ctrl-C does, and since nobody reads
        the terminal any more (writing to it would fail mid-stop), write what the
        stop says to ``stop.log`` next to the state directory instead."""
        self.output.detach("SIGHUP")
        self.say("terminal closed (SIGHUP): stopping as on Ctrl-C")
        stop.set()

    async def preflight(self) -> None:
        await self.stop_leftovers()
        self.prepare_tls()
        pruned = state.prune(self.config.state_dir, older_than_s=self.prune_after_s)
        if pruned:
            self.say(
                f"removed {len(pruned)} stopped sandbox(es)' directories, stopped more than "
                f"{self.prune_after_s / 3600:g} h ago, from {self.config.state_dir}"
            )
        check_tiers(self.config)
        check_commands(self.config)
        # Another checkout's stack may hold the default ports: take free ones then.
        self.config, moved = settle_ports(self.config)
        for line in moved:
            self.say(line)
        check_ports(self.config)
        self.runtime_user_env, note = await asyncio.to_thread(
            runtime_user_env, self.config.state_dir, {**os.environ, **self.config.extra_env}
        )
        if note is not None:
            self.say(note)
        if generate_key_pair(self.config.signing_key_file, self.config.public_keys_file):
            self.say(f"generated a sandbox-credential key pair in {self.config.credentials_dir}")
        await check_redis(self.config.redis_url)
        if await ensure_database(self.config.database_url):
            self.say(f"created database {redacted(self.config.database_url)}")
        self.say("applying migrations")
        await migrate(self.config, self.printer)
        await self.start_traces()

    async def start_traces(self) -> None:
        """Choose where the services' spans go (:mod:`.trace_sink`), start it, and
        give the services its endpoint."""
        self.traces = await TraceSink.start(
            state.path_for(self.config.state_dir).with_name("traces")
        )
        for note in self.traces.notes:
            self.say(note)
        extra = {**self.config.extra_env, **self.traces.environment()}
        self.config = replace(self.config, extra_env=extra)

    async def start(self, stop: asyncio.Event) -> bool:
        for spec in self.config.services():
            command = find_command(spec.command)
            assert command is not None
            proc = await asyncio.create_subprocess_exec(
                command,
                env={
                    **self.config.environment(spec),
                    **(self.runtime_user_env if spec.name == "substrate" else {}),
                },
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
                preexec_fn=procs.die_with_parent,
            )
            assert proc.stdout is not None
            pump = asyncio.create_task(self.printer.pump(spec.name, proc.stdout))
            self.running[spec.name] = Running(spec, proc, pump)
            self.say(f"started {spec.name} (pid {proc.pid}) on {spec.address}")
        credentials = self.credentials()
        waits = {
            name: asyncio.create_task(
                wait_serving(
                    r.spec.address,
                    timeout_s=self.startup_timeout_s,
                    service=SERVICE_NAMES[r.spec.name],
                    credentials=credentials,
                    options=self.server_options(name),
                )
            )
            for name, r in self.running.items()
        }
        exits = {name: asyncio.create_task(r.proc.wait()) for name, r in self.running.items()}
        stopped = asyncio.create_task(stop.wait())
        try:
            pending = set(waits.values())
            while pending:
                done, _ = await asyncio.wait(
                    [*pending, *exits.values(), stopped], return_when=asyncio.FIRST_COMPLETED
                )
                if stopped in done:
                    self.say("interrupted while starting")
                    return False
                for name, task in exits.items():
                    if task in done:
                        self.say(f"{name} exited during start-up (exit {task.result()})")
                        return False
                for name, task in waits.items():
                    if task in done and task in pending:
                        pending.discard(task)
                        if not task.result():
                            self.say(f"{name} did not report SERVING in time")
                            return False
                        self.say(f"{name} is SERVING")
            return True
        finally:
            for task in [*waits.values(), *exits.values(), stopped]:
                task.cancel()

    async def start_prometheus(self) -> None:
        """Start a Prometheus scraping the stack, when installed and asked for."""
        config = self.config
        binary = prometheus.find_binary()
        if config.prometheus_port == 0:
            self.prometheus_note = "off (--prometheus-port 0)"
            return
        if binary is None or not any(config.metrics_ports):
            if binary is not None:
                self.prometheus_note = "off (every metrics port is 0)"
            return
        rules = prometheus.find_rules()
        local = prometheus.LocalPrometheus(
            directory=state.path_for(config.state_dir).with_name("prometheus"),
            port=config.prometheus_port,
            metrics_ports=config.metrics_ports,
            rules=rules,
            scrape_interval_s=config.prometheus_scrape_s,
        )
        if await local.start(binary):
            self.prometheus = local
            self.prometheus_note = local.url + (
                f" (rules: {rules})" if rules else " (no rules file found)"
            )
        else:
            self.prometheus_note = (
                f"did not start on :{config.prometheus_port} "
                f"(see {local.directory / 'prometheus.log'})"
            )
        self.say(f"Prometheus: {self.prometheus_note}")

    def banner(self) -> None:
        config = self.config
        table = Table(title="Turnstile is up — Ctrl-C stops everything", title_justify="left")
        for column in ("service", "gRPC", "metrics", "pid"):
            table.add_column(column)
        for name, r in self.running.items():
            metrics = (
                f"http://127.0.0.1:{r.spec.metrics_port}/metrics" if r.spec.metrics_port else "off"
            )
            table.add_row(name, r.spec.address, metrics, str(r.proc.pid))
        self.console.print(table)
        tiers = parse_tiers(config.tiers, config.default_tier)
        rows = {
            "Redis": f"{redacted(config.redis_url)} (prefix {config.redis_prefix})",
            "PostgreSQL": redacted(config.database_url),
            "tiers": (
                ", ".join(f"{t} (default)" if t == tiers.default else t for t in tiers.declared)
                + f"; grace {config.grace_s:g} s"
                if tiers.enabled
                else f"none; grace {config.grace_s:g} s"
            ),
            "runtimes": f"{config.state_dir.absolute()} (each sandbox's log: <id>/runtime.log)",
            "Prometheus": self.prometheus_note,
            "traces": self.traces.summary() if self.traces is not None else "not exported",
            "try": "turnstilectl demo · turnstilectl status · turnstilectl --help",
        }
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold cyan")
        grid.add_column()
        for name, value in rows.items():
            grid.add_row(name, value)
        self.console.print(grid)

    async def wait_for_stop_or_death(self, stop: asyncio.Event) -> str | None:
        exits = {asyncio.create_task(r.proc.wait()): name for name, r in self.running.items()}
        stopped = asyncio.create_task(stop.wait())
        try:
            done, _ = await asyncio.wait([*exits, stopped], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in [*exits, stopped]:
                task.cancel()
        if stopped in done:
            return None
        return next(exits[task] for task in done if task in exits)

    def describe(self) -> None:
        """Write ``stack.json`` for commands run in other shells, and for the next
        ``up``: the runner and every process it started, by pid and start time, so
        a runner killed outright leaves a list of what to stop; and the user's copy
        (:func:`state.user_file`), so the CLI finds this stack from any directory,
        with its transport and Redis prefix."""
        config = self.config
        description = self.description()
        state.write(state.path_for(config.state_dir), description)
        try:
            state.publish(description)
        except OSError as error:  # a read-only home: commands then need flags or variables
            self.say(f"could not write {state.user_file()} ({error.strerror})")

    def description(self) -> dict[str, object]:
        config = self.config
        a, s, f = config.addresses
        pids = [r.proc.pid for r in self.running.values()]
        if self.prometheus is not None and self.prometheus.proc is not None:
            pids.append(self.prometheus.proc.pid)
        if self.traces is not None and self.traces.pid is not None:
            pids.append(self.traces.pid)
        transport: dict[str, object] = (
            {"mode": "plaintext"}
            if config.tls_dir is None
            else {
                "mode": "mtls",
                "dir": str(config.tls_dir.absolute()),
                "cert": config.tls_file("cli.crt"),
                "key": config.tls_file("cli.key"),
                "ca": config.tls_file("ca.crt"),
                "server_ids": {
                    name: f"spiffe://{TRUST_DOMAIN}/{HOLDERS[name]}" for name in SERVICE_NAMES
                },
            }
        )
        return {
            "format": state.FORMAT,
            "pid": os.getpid(),
            "runner": state.process_record(os.getpid()),
            "processes": [r for r in map(state.process_record, pids) if r is not None],
            "state_dir": str(config.state_dir.absolute()),
            "tiers": config.tiers,
            "default_tier": config.default_tier,
            "addresses": {"admission": a, "substrate": s, "affinity": f},
            "transport": transport,
            "redis_url": config.redis_url,
            "redis_prefix": config.redis_prefix,
            "database": redacted(config.database_url),
            "metrics_ports": dict(zip(SERVICE_NAMES, config.metrics_ports, strict=True)),
            "prometheus": self.prometheus.url if self.prometheus is not None else None,
            "traces": self.traces.description() if self.traces is not None else None,
        }

    async def stop_leftovers(self) -> None:
        """Stop what an earlier stack on this state directory left running.

        A runner killed outright (SIGKILL, a crash) cannot stop anything; its
        ``stack.json`` stays behind, naming the runner and what it started. If
        that runner still runs, this is a second stack: refuse. Otherwise stop
        every process it recorded and every runtime the state directory records
        that still runs (left alone, those workers would attach to the new stack
        and take its sessions), and say so."""
        path = state.path_for(self.config.state_dir)
        last = state.read(path)
        if last is None:
            return
        runner = state.recorded_runner(last)
        if runner is not None and procs.alive(runner):
            raise PreflightError(
                f"a stack already runs on {self.config.state_dir} (pid {runner.pid}); "
                "stop it first (Ctrl-C in its terminal, or kill it)"
            )
        left = state.leftovers(last, self.config.state_dir)
        if left:
            self.say(
                f"the last stack (pid {last.get('pid', '?')}) did not stop cleanly; stopping "
                f"what it left: " + ", ".join(f"{p.command}[{p.pid}]" for p in left)
            )
            await self.stop_processes(left)
        path.unlink(missing_ok=True)
        if isinstance(last.get("pid"), int):
            with contextlib.suppress(OSError):
                state.retire(last["pid"])

    async def stop_processes(self, left: list[procs.Proc]) -> None:
        """SIGTERM each process's group, SIGKILL what is still there after 5 s."""
        for proc in left:
            procs.signal_group_of(proc, signal.SIGTERM)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(self.stop_grace_s, 5.0)
        while any(procs.alive(p) for p in left) and loop.time() < deadline:
            procs.reap_orphans()
            await asyncio.sleep(0.05)
        for proc in left:
            procs.signal_group_of(proc, signal.SIGKILL)
        procs.reap_orphans()

    async def stop(self) -> None:
        self.say("stopping")
        substrate = self.running.get("substrate")
        if substrate is not None and substrate.alive:
            await self.deactivate_sandboxes(substrate.spec.address)
        await self.terminate(["affinity"])
        await self.terminate([n for n in self.running if n != "affinity"])
        if self.prometheus is not None:  # before the sweep, which would count it a leftover
            await self.prometheus.stop()
        if self.traces is not None:  # after the services: their last spans are in
            await self.traces.stop()
        await self.sweep()
        # Last: until everything is stopped, the next ``up`` can still find it here.
        with contextlib.suppress(OSError):
            state.path_for(self.config.state_dir).unlink()
        if self.guard is not None:  # nothing left for it to stop
            await asyncio.to_thread(guard.stand_down, *self.guard)
            self.guard = None
        with contextlib.suppress(OSError):
            state.retire(os.getpid())
        self.say("stopped")

    async def terminate(self, names: list[str]) -> None:
        """SIGTERM the services' groups; SIGKILL what is left after the grace."""
        targets = [self.running[n] for n in names if n in self.running]
        for r in targets:
            if r.alive:
                r.signal_group(signal.SIGTERM)
        for r in targets:
            try:
                await asyncio.wait_for(r.proc.wait(), self.stop_grace_s)
            except TimeoutError:
                self.say(f"{r.spec.name} ignored SIGTERM for {self.stop_grace_s:g} s: SIGKILL")
            # Whatever is left in the group (the leader, or a child it left).
            r.signal_group(signal.SIGKILL)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(r.proc.wait(), 5)
            with contextlib.suppress(Exception):
                await asyncio.wait_for(r.pump, 2)

    async def deactivate_sandboxes(self, address: str) -> None:
        """Stop every running sandbox through the substrate (best effort, bounded)."""
        try:
            credentials = self.credentials()
            channel = (
                grpc.aio.secure_channel(
                    address, credentials, options=self.server_options("substrate")
                )
                if credentials is not None
                else grpc.aio.insecure_channel(address)
            )
            async with channel:
                stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
                running: list[str] = []
                token = ""
                while True:
                    page = await stub.ListSandboxes(
                        substrate_pb2.ListSandboxesRequest(page_size=1000, page_token=token),
                        timeout=5,
                    )
                    running += [
                        s.sandbox_id
                        for s in page.sandboxes
                        if s.state != substrate_pb2.SANDBOX_STATE_STOPPED
                    ]
                    token = page.next_page_token
                    if not token:
                        break
                if running:
                    self.say(f"stopping {len(running)} sandbox runtime(s)")
                await asyncio.gather(
                    *(
                        stub.Deactivate(
                            substrate_pb2.DeactivateRequest(sandbox_id=sandbox_id),
                            timeout=self.stop_grace_s,
                        )
                        for sandbox_id in running
                    ),
                    return_exceptions=True,
                )
        except grpc.aio.AioRpcError as error:
            self.say(f"could not deactivate sandboxes ({error.code().name}); sweeping instead")

    async def sweep(self) -> None:
        """Stop anything still below the runner: runtimes orphaned by a dead substrate."""
        mine = {self.guard[0].pid} if self.guard is not None else set()
        left = [p for p in procs.descendants(os.getpid()) if p.pid not in mine]
        if left:
            self.say(
                f"stopping {len(left)} leftover process(es): "
                + ", ".join(f"{p.command}[{p.pid}]" for p in left)
            )
            await self.stop_processes(left)
        procs.reap_orphans()
