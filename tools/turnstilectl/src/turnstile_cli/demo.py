"""``demo``: a short story told against the running local stack, step by step.

1. two clients activate sandboxes in two tiers;
2. one hits its in-flight cap (concurrency);
3. one is refused by the rate limiter, waits the hint it was given, and gets in;
4. a contended cluster bucket: globex floods it with waiting calls, acme's few
   calls wait their fair turn and are served within a refill or two (SPEC Q1);
5. sessions are placed in two tiers, and stick to their sandbox;
6. a worker is killed: its session is "pending" during the grace period (the
   wake affinity sends on the client's behalf is refused: it is out of tokens);
7. the session falls back to another sandbox of its tier, with a workspace reset;
8. acme, with a tenant's own certificate, tries globex's sandbox: refused with the
   answer a sandbox that does not exist gets, and globex's record is untouched;
9. ``turnstilectl why`` on the sandbox the rate limiter refused in step 3: the
   decision log says what refused it, in words, with the trace id (SPEC Q3).

Each step runs under a root span of its own, so its trace id (printed) finds
the whole path in Jaeger when ``OTEL_EXPORTER_OTLP_ENDPOINT`` points at it.
Limits and the key set are changed as ``turnstilectl limits`` and ``keys`` change
them, through admission's admin API (SPEC M1) with the CLI's (operator's)
certificate, so each change is in the decision log. Client ids carry a
per-run suffix, so the story can be told again on the same stack; the run's
allowlist entries and limits are removed at the end, its sandboxes are left
running to look at.

Killing a worker needs its pid, which the Direct substrate reports as the
runtime name (``proc-<pid>``): this step works against the local stack only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import functools
import json
import os
import signal
import sys
import tempfile
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import grpc.aio
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from rich.console import Console
from rich.markup import escape
from rich.rule import Rule

from turnstile_cli import admin_api
from turnstile_cli.commands.admission import render_admit
from turnstile_cli.commands.affinity import render_place, reset_warning
from turnstile_cli.commands.decisions import render_why
from turnstile_cli.commands.substrate import render_activate
from turnstile_cli.context import ClientTls, Context
from turnstile_cli.exits import Exit
from turnstile_cli.output import queue_rows, render_error
from turnstile_client import Refused, TurnstileError, decode
from turnstile_contracts import (
    admission_pb2,
    affinity_pb2,
    common_pb2,
    substrate_pb2,
)
from turnstile_platform import tracing
from turnstile_platform.pki import CertificateAuthority

T = TypeVar("T")

STEPS = 9
#: Step 4 (the fair queue): the cluster bucket's rate while globex floods it, the
#: flood's calls always waiting, acme's calls, the wait budget each call has, and
#: how long the flood runs before acme's first call.
FAIR_RATE = 8.0
FLOOD_LOOPS = 12
LIGHT_CALLS = 3
FAIR_WAIT_S = 10.0
FLOOD_HEAD_START_S = 1.0
#: The limits document of the cluster bucket (``turnstilectl limits set --cluster``).
CLUSTER_FIELD = "cluster"


class DemoError(Exception):
    """The story could not go on; the message says why."""


@dataclass
class Story:
    ctx: Context
    console: Console
    tracer: trace.Tracer
    max_wait_s: float
    run: str = field(default_factory=lambda: uuid.uuid4().hex[:4])
    traces: list[dict[str, str]] = field(default_factory=list)
    #: The sandbox the rate limiter refused (step 3), which step 8 asks ``why`` about.
    refused_sandbox: str = ""

    @property
    def acme(self) -> str:
        return f"acme-{self.run}"

    @property
    def globex(self) -> str:
        return f"globex-{self.run}"

    def sandbox(self, name: str) -> str:
        return f"{name}-{self.run}"

    # -- narration ---------------------------------------------------------

    @contextlib.asynccontextmanager
    async def step(self, number: int, title: str, text: str) -> AsyncIterator[None]:
        self.console.print()
        self.console.print(Rule(f"[bold]{number}/{STEPS}  {escape(title)}", align="left"))
        self.console.print(f"[dim]{escape(text)}[/]")
        with self.tracer.start_as_current_span(f"demo {number}: {title}") as span:
            trace_id = format(span.get_span_context().trace_id, "032x")
            self.progress(number, title, trace_id, "started")
            yield
        self.traces.append({"step": f"{number}. {title}", "trace_id": trace_id})
        self.progress(number, title, trace_id, "done")
        self.console.print(f"[dim]trace[/] [bold blue]{trace_id}[/]")

    def progress(self, number: int, title: str, trace_id: str, state: str) -> None:
        """With ``--json``, one JSON line per step start and end on stderr (stdout
        keeps its one object), so a script sees the story move."""
        if self.ctx.out.json_mode:
            line = {"step": number, "of": STEPS, "title": title, "trace_id": trace_id}
            print(json.dumps({**line, "state": state}), file=sys.stderr, flush=True)

    def shell(self, line: str) -> None:
        self.console.print(f"[bold]$[/] [cyan]{escape(line)}[/]")

    def say(self, text: str) -> None:
        self.console.print(f"[italic]{escape(text)}[/]")

    # -- calls ---------------------------------------------------------------

    async def activate(
        self, sandbox_id: str, client_id: str, tier: str
    ) -> substrate_pb2.ActivateResponse:
        self.shell(f"turnstilectl activate {sandbox_id} --client {client_id} --tier {tier}")
        # Through the typed client (docs/clients.md): a refusal raises Refused.
        async with self.ctx.client("substrate") as client:
            response = await client.activate(sandbox_id, client_id, tier=tier)
        render_activate(self.console, response)
        return response

    async def place(self, session_id: str, tier: str, client: str) -> affinity_pb2.PlaceResponse:
        """One turn of ``client``'s session: Place, show it (reset warning first), release
        the lease."""
        self.shell(f"turnstilectl place {session_id} --client {client} --tier {tier} --release")
        async with self.ctx.affinity() as stub:
            response = await stub.Place(
                affinity_pb2.PlaceRequest(session_id=session_id, tier=tier, client_id=client)
            )
            released = await stub.ReleaseLease(
                affinity_pb2.ReleaseLeaseRequest(
                    sandbox_id=response.sandbox_id, lease_id=response.lease_id, client_id=client
                )
            )
        if response.HasField("reset"):
            self.console.print(
                f"[bold black on yellow] WARNING [/] "
                f"[yellow]{escape(reset_warning(response.reset, session_id))}[/]"
            )
        render_place(self.console, session_id, response, released.released)
        return response

    def refused(self, error: TurnstileError, action: str) -> None:
        self.console.print(render_error(error, action=action))

    async def set_limits(self, key: str, limits: dict[str, float]) -> None:
        text = json.dumps(limits)
        self.shell(f"turnstilectl limits set {key} '{text}'")
        await self._put(admin_api.target(key), limits)

    async def clear_limits(self, key: str) -> None:
        await self._put(admin_api.target(key), None)

    async def _put(self, where: Any, document: dict[str, Any] | None) -> None:
        """Store ``document`` as ``where``'s limits (None: delete them)."""
        async with self.ctx.admin() as admin:
            if document is None:
                await admin.DeleteLimits(admission_pb2.DeleteLimitsRequest(target=where))
                return
            try:
                message, _ = admin_api.to_message(document)
            except admin_api.DocumentError as error:
                raise DemoError(f"limits: {error}") from error
            await admin.SetLimits(admission_pb2.SetLimitsRequest(target=where, limits=message))

    async def keys(self, *, allow: tuple[str, ...] = (), remove: tuple[str, ...] = ()) -> int:
        async with self.ctx.admin() as admin:
            changed = await admin.UpdateKeySet(
                admission_pb2.UpdateKeySetRequest(allow=allow, remove=remove)
            )
        return int(changed.key_set.version)

    async def wait_for_worker(self, sandbox_id: str, *, present: bool = True) -> None:
        """Until the sandbox's worker is attached to the relay (or, ``present=False``, gone)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.max_wait_s
        async with self.ctx.affinity() as stub:
            while loop.time() < deadline:
                workers = await stub.ListWorkers(affinity_pb2.ListWorkersRequest())
                if any(w.sandbox_id == sandbox_id for w in workers.workers) == present:
                    return
                await asyncio.sleep(0.1)
        raise DemoError(
            f"the worker of {sandbox_id} never {'attached to' if present else 'left'} the relay"
        )

    # -- the story -----------------------------------------------------------

    async def tell(self) -> None:
        self.console.print(
            f"[bold]Turnstile demo[/] (run {self.run}): admission → substrate → affinity, "
            f"against {self.ctx.targets.admission}, {self.ctx.targets.substrate}, "
            f"{self.ctx.targets.affinity}"
        )
        container = await self.activations()
        await self.in_flight_cap()
        await self.rate_refusal()
        await self.fair_turn()
        microvm_session = await self.two_tiers(container)
        killed = await self.kill_worker(microvm_session)
        await self.fallback(microvm_session, killed)
        await self.cross_tenant()
        await self.why_refused()

    async def activations(self) -> str:
        acme_box = self.sandbox("acme-1")
        async with self.step(
            1,
            "Two clients activate sandboxes",
            f"{self.acme} and {self.globex} get a bucket of their own (the allowlist), then "
            f"activate sandboxes: {self.acme} in the container tier, {self.globex} two in "
            "microvm. Each activation is admitted (cap, rate, concurrency) before its runtime "
            "is created, and charged to a bounded key.",
        ):
            self.shell(f"turnstilectl keys allow {self.acme} {self.globex}")
            version = await self.keys(allow=(self.acme, self.globex))
            self.say(f"key set is now version {version}; every replica has it within a second")
            await asyncio.sleep(1.0)
            await self.activate(acme_box, self.acme, "container")
            for n in (1, 2):
                await self.activate(self.sandbox(f"globex-{n}"), self.globex, "microvm")
        return acme_box

    async def in_flight_cap(self) -> None:
        async with self.step(
            2,
            f"{self.acme} hits its in-flight limit (concurrency)",
            "Its limits allow 2 activations in flight. Two slow activations hold their "
            "admission (a hold each, as the substrate takes while a runtime starts); the third "
            "is refused with the limit, the current value and when to retry. The live-sandbox "
            "cap refuses the same way (CAP_EXCEEDED): the local stack's Direct substrate "
            "counts its runtimes (the cap's current value), as Kubernetes counts pods.",
        ):
            await self.set_limits(self.acme, {"concurrency": 2})
            holds: list[str] = []
            async with self.ctx.admission() as stub:
                for n in (1, 2, 3):
                    sandbox_id = self.sandbox(f"acme-slow-{n}")
                    self.shell(f"turnstilectl admit {sandbox_id} --client {self.acme}")
                    response = await stub.Admit(
                        admission_pb2.AdmitRequest(
                            sandbox_id=sandbox_id,
                            client=common_pb2.ActivationClient(client_id=self.acme),
                            kind=common_pb2.ACTIVATION_KIND_COLD_CREATE,
                        )
                    )
                    render_admit(self.console, sandbox_id, response)
                    if response.decision == admission_pb2.DECISION_ADMITTED:
                        holds.append(response.hold_id)
                if len(holds) != 2:
                    raise DemoError(f"expected 2 of 3 admitted, got {len(holds)}")
                for hold_id in holds:
                    self.shell(f"turnstilectl hold cancel {hold_id}")
                    await stub.CancelHold(admission_pb2.CancelHoldRequest(hold_id=hold_id))
            self.say("both holds cancelled: their tokens went back, nothing stays pending")

    async def rate_refusal(self) -> None:
        async with self.step(
            3,
            f"{self.acme} is rate limited, waits, and gets in",
            "Now its bucket holds 2 tokens and refills at one every 2 s. Activations take a "
            "token each until one is refused; the refusal says when a token is back, and the "
            "retry after that long is admitted.",
        ):
            await self.set_limits(self.acme, {"rate": 0.5, "burst": 2})
            for n in range(2, 7):
                sandbox_id = self.sandbox(f"acme-{n}")
                try:
                    await self.activate(sandbox_id, self.acme, "container")
                except Refused as error:
                    if error.reason != "RATE_LIMITED":
                        raise
                    self.refused(error, "activate")
                    self.refused_sandbox = sandbox_id
                    wait = error.retry_after_s or 1.0
                    self.say(f"waiting {wait:.1f} s as told, then retrying")
                    await asyncio.sleep(wait)
                    again = functools.partial(self.activate, sandbox_id, self.acme, "container")
                    await self.retry(again)
                    return
            raise DemoError("no activation was rate limited")

    async def fair_turn(self) -> None:
        """Step 4: the cluster bucket at ``FAIR_RATE`` a second, globex's
        ``FLOOD_LOOPS`` calls waiting in the fair queue all the time, and acme's
        ``LIGHT_CALLS`` calls, one after another, served at their fair share."""
        async with self.step(
            4,
            f"{self.globex} floods a contended cluster, {self.acme} still gets its turn",
            f"The cluster bucket now refills {FAIR_RATE:g} tokens a second, one at a time. "
            f"{self.globex} keeps {FLOOD_LOOPS} calls waiting for it (a wait budget each: they "
            f"join the fair queue instead of being refused); {self.acme} asks {LIGHT_CALLS} "
            "times, one after another. The queue serves the two clients' waiters in turn, so "
            f"{self.acme} waits about a refill at its half share, not behind the whole flood.",
        ):
            saved = await self._limit_docs(CLUSTER_FIELD, self.acme, self.globex)
            try:
                await self._fair_turn()
            finally:
                await self._restore_limits(saved)
            self.say("the cluster bucket and both clients' limits are as they were")

    async def _fair_turn(self) -> None:
        roomy: dict[str, float] = {
            "cap": 10_000,
            "concurrency": 10_000,
            "rate": 1_000,
            "burst": 1_000,
        }
        for client_id in (self.acme, self.globex):
            await self.set_limits(client_id, roomy)
        cluster = {"rate": FAIR_RATE, "burst": 1}
        self.shell(f"turnstilectl limits set --cluster '{json.dumps(cluster)}'")
        await self._put(admin_api.target(None, cluster=True), cluster)
        flooding = asyncio.Event()
        flood_waits: list[float] = []
        async with self.ctx.admission() as stub:

            async def flood(loop_number: int) -> None:
                n = 0
                while not flooding.is_set():
                    n += 1
                    sandbox_id = self.sandbox(f"flood-{loop_number}-{n}")
                    answer = await self._admit_waiting(stub, sandbox_id, self.globex)
                    if answer.HasField("waited"):
                        flood_waits.append(answer.waited.ToMilliseconds() / 1000)

            self.shell(
                f"# {FLOOD_LOOPS}× in a loop: turnstilectl admit flood-N --client {self.globex} "
                f"--kind warm --wait {FAIR_WAIT_S:g}s"
            )
            loops = [asyncio.create_task(flood(n)) for n in range(FLOOD_LOOPS)]
            try:
                await asyncio.sleep(FLOOD_HEAD_START_S)  # the flood fills the queue first
                light_waits = []
                for n in range(1, LIGHT_CALLS + 1):
                    sandbox_id = self.sandbox(f"acme-fair-{n}")
                    self.shell(
                        f"turnstilectl admit {sandbox_id} --client {self.acme} --kind warm "
                        f"--wait {FAIR_WAIT_S:g}s"
                    )
                    answer = await self._admit_waiting(stub, sandbox_id, self.acme)
                    if answer.decision != admission_pb2.DECISION_ADMITTED:
                        raise DemoError(f"{sandbox_id} was not admitted: {answer.message}")
                    waited = answer.waited.ToMilliseconds() / 1000
                    light_waits.append(waited)
                    self.console.print(
                        f"[bold green]✓ admitted[/] {escape(_fair_line(sandbox_id, answer))}"
                    )
            finally:
                flooding.set()
                await asyncio.gather(*loops, return_exceptions=True)
        if not flood_waits:
            raise DemoError(f"none of {self.globex}'s calls waited: the bucket was not contended")
        flood_waits.sort()
        self.say(
            f"{self.acme} waited {', '.join(f'{w:.2f} s' for w in light_waits)}; "
            f"{self.globex}'s {len(flood_waits)} admissions meanwhile waited "
            f"{flood_waits[len(flood_waits) // 2]:.2f} s at the median (its calls queue behind "
            "each other, FIFO within a client)"
        )

    async def _admit_waiting(
        self, stub: Any, sandbox_id: str, client_id: str
    ) -> admission_pb2.AdmitResponse:
        """One warm claim that may wait ``FAIR_WAIT_S`` in the fair queue; an admitted
        one is committed and its sandbox released at once (the token stays spent, as a
        real activation's would: nothing else is left behind)."""
        request = admission_pb2.AdmitRequest(
            sandbox_id=sandbox_id,
            client=common_pb2.ActivationClient(client_id=client_id),
            kind=common_pb2.ACTIVATION_KIND_WARM_CLAIM,
        )
        request.wait_budget.FromSeconds(int(FAIR_WAIT_S))
        answer: admission_pb2.AdmitResponse = await stub.Admit(
            request, timeout=FAIR_WAIT_S + self.ctx.timeout_s
        )
        if answer.decision == admission_pb2.DECISION_ADMITTED:
            await stub.CommitHold(admission_pb2.CommitHoldRequest(hold_id=answer.hold_id))
            await stub.ReleaseSandbox(admission_pb2.ReleaseSandboxRequest(sandbox_id=sandbox_id))
        return answer

    async def _limit_docs(self, *keys: str) -> dict[str, tuple[Any, dict[str, Any] | None]]:
        """The stored documents of the cluster (``CLUSTER_FIELD``) or of keys, to put back."""
        docs: dict[str, tuple[Any, dict[str, Any] | None]] = {}
        async with self.ctx.admin() as admin:
            for key in keys:
                where = admin_api.target(
                    None if key == CLUSTER_FIELD else key, cluster=key == CLUSTER_FIELD
                )
                got = await admin.GetLimits(admission_pb2.GetLimitsRequest(target=where))
                found = [admin_api.to_document(d.limits) for d in got.documents]
                docs[key] = (where, found[0] if found else None)
        return docs

    async def _restore_limits(self, docs: dict[str, tuple[Any, dict[str, Any] | None]]) -> None:
        for where, doc in docs.values():
            await self._put(where, doc)

    async def why_refused(self) -> None:
        sandbox_id = self.refused_sandbox
        async with self.step(
            9,
            f"Why was {sandbox_id} refused?",
            "Every decision is in the decision log, written by admission's decision script in "
            "the same step as the decision, with the substrate's side beside it; "
            "`turnstilectl why` reads a sandbox's last activations back, newest first: what "
            "decided each, in words, and the trace id to look up.",
        ):
            self.shell(f"turnstilectl why {sandbox_id}")
            async with self.ctx.admission() as stub:
                page = await stub.ListDecisions(
                    admission_pb2.ListDecisionsRequest(sandbox_id=sandbox_id, limit=5)
                )
            entries = list(page.decisions)
            if not any(d.kind == "refused" for d in entries):
                raise DemoError(f"the decision log has no refusal of {sandbox_id}")
            render_why(self.console, sandbox_id, entries)

    async def retry(self, call: Callable[[], Awaitable[T]], attempts: int = 5) -> T:
        """Call again while the answer is a retryable refusal, waiting its hint."""
        for _ in range(attempts - 1):
            try:
                return await call()
            except (grpc.aio.AioRpcError, TurnstileError) as raw:
                error = raw if isinstance(raw, TurnstileError) else decode(raw)
                if error.retry_after_s is None:
                    raise
                self.refused(error, "retry")
                await asyncio.sleep(error.retry_after_s)
        return await call()

    async def two_tiers(self, container_box: str) -> tuple[str, str]:
        chat_a, chat_b = self.sandbox("chat-a"), self.sandbox("chat-b")
        async with self.step(
            5,
            "Sessions are placed in two tiers, and stay",
            "A session belongs to its client: its first turn goes to the least-loaded of that "
            "client's sandboxes in its tier (never another client's); later turns go back to "
            "the same sandbox (its workspace is there).",
        ):
            for sandbox_id in (
                container_box,
                self.sandbox("globex-1"),
                self.sandbox("globex-2"),
            ):
                await self.wait_for_worker(sandbox_id)
            first_a = await self.place(chat_a, "container", self.acme)
            first_b = await self.place(chat_b, "microvm", self.globex)
            again = await self.place(chat_b, "microvm", self.globex)
            if again.sandbox_id != first_b.sandbox_id:
                raise DemoError("the second turn did not stick to its sandbox")
            self.say(
                f"{chat_a} is on {first_a.sandbox_id} ({first_a.tier}); "
                f"{chat_b} is on {first_b.sandbox_id} ({first_b.tier}), twice"
            )
        return chat_b, first_b.sandbox_id

    async def kill_worker(self, session: tuple[str, str]) -> str:
        chat_b, sandbox_id = session
        async with self.step(
            6,
            f"The worker of {sandbox_id} is killed",
            f"First {self.globex} spends its last activation token, so that the wake affinity "
            "sends on its behalf (Activate with client=inherit) is refused. Then the worker "
            f"process is killed. {chat_b}'s next turns are 'pending' while the grace period "
            "runs: retryable, with a hint when to come back.",
        ):
            await self.set_limits(self.globex, {"rate": 0.01, "burst": 1})
            for n in range(3, 6):
                try:
                    await self.activate(self.sandbox(f"globex-{n}"), self.globex, "microvm")
                except Refused as error:
                    if error.reason != "RATE_LIMITED":
                        raise
                    self.refused(error, "activate")
                    break
            else:
                raise DemoError(f"{self.globex} was never out of tokens")
            async with self.ctx.substrate() as stub:
                got = await stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id=sandbox_id))
            pid = _runtime_pid(got.sandbox)
            self.shell(f"kill -KILL -{pid}   # the runtime's process group")
            os.killpg(pid, signal.SIGKILL)
            await self.wait_for_worker(sandbox_id, present=False)
            self.say(f"the relay saw {sandbox_id}'s stream end: it is absent, detach mark written")
        return sandbox_id

    async def fallback(self, session: tuple[str, str], killed: str) -> None:
        chat_b, _ = session
        async with self.step(
            7,
            f"{chat_b} waits out the grace, then falls back",
            "Each turn is answered 'pending' until the grace period ends; the wake was "
            "refused, so the sandbox does not come back. The session then moves to the "
            f"least-loaded of {self.globex}'s sandboxes in its tier (never another client's), "
            "and the move is reported as a workspace reset.",
        ):
            loop = asyncio.get_running_loop()
            deadline = loop.time() + self.max_wait_s
            while True:
                try:
                    response = await self.place(chat_b, "microvm", self.globex)
                except grpc.aio.AioRpcError as raw:
                    error = decode(raw)
                    if error.reason != "SANDBOX_PENDING" or loop.time() > deadline:
                        raise
                    self.refused(error, "place")
                    await asyncio.sleep(error.retry_after_s or 1.0)
                    continue
                if not response.HasField("reset"):
                    if response.sandbox_id == killed:
                        raise DemoError(f"{killed} came back: the wake was not refused")
                    raise DemoError("the session moved without a workspace reset")
                if response.sandbox_id not in {self.sandbox(f"globex-{n}") for n in range(1, 6)}:
                    raise DemoError(f"{chat_b} moved to {response.sandbox_id}, not {self.globex}'s")
                return

    async def cross_tenant(self) -> None:
        theirs, missing = self.sandbox("globex-2"), self.sandbox("globex-9")
        async with self.step(
            8,
            f"{self.acme} cannot touch {self.globex}'s sandboxes",
            f"Now as a tenant: a certificate of {self.acme}'s own "
            f"(spiffe://turnstile.local/client/{self.acme}), which may act for {self.acme} "
            f"only. It asks for {theirs} (running, {self.globex}'s) charged to itself, and "
            f"for {missing}, which does not exist: one answer for both, so it learns "
            f"nothing, and {self.globex}'s record stays as it was.",
        ):
            before = await self._record(theirs)
            with tenant_tls(self.ctx, f"client/{self.acme}") as tls:
                tenant = dataclasses.replace(self.ctx, tls=tls)
                answers = []
                for sandbox_id in (theirs, missing):
                    self.shell(
                        f"turnstilectl --cert {self.acme}.crt --key {self.acme}.key activate "
                        f"{sandbox_id} --client {self.acme} --tier microvm"
                    )
                    answers.append(await self._refused_activate(tenant, sandbox_id))
            shapes = {
                (a.code, a.reason, a.message.replace(s, "<id>"))
                for a, s in zip(answers, (theirs, missing), strict=True)
            }
            if len(shapes) != 1:
                raise DemoError(f"{theirs} and {missing} were answered differently: {shapes}")
            after = await self._record(theirs)
            if after != before:
                raise DemoError(f"{theirs}'s record changed: {before} → {after}")
            self.say(
                f"the same {answers[0].code.name} for both; {theirs} is still charged to "
                f"{after[0]} and {after[1].lower()}"
            )

    async def _refused_activate(self, tenant: Context, sandbox_id: str) -> TurnstileError:
        async with tenant.substrate() as stub:
            try:
                await stub.Activate(
                    substrate_pb2.ActivateRequest(
                        sandbox_id=sandbox_id,
                        client=common_pb2.ActivationClient(client_id=self.acme),
                        tier="microvm",
                    )
                )
            except grpc.aio.AioRpcError as raw:
                error = decode(raw)
                self.refused(error, "activate")
                return error
        raise DemoError(f"{self.acme} activated {sandbox_id}: ownership was not enforced")

    async def _record(self, sandbox_id: str) -> tuple[str, str]:
        """Who ``sandbox_id`` is charged to and its state, as the operator sees it."""
        async with self.ctx.substrate() as stub:
            found = await stub.GetSandbox(substrate_pb2.GetSandboxRequest(sandbox_id=sandbox_id))
        state = substrate_pb2.SandboxState.Name(found.sandbox.state).removeprefix("SANDBOX_STATE_")
        return found.sandbox.activating_client_id, state


@contextlib.contextmanager
def tenant_tls(ctx: Context, path: str) -> Iterator[ClientTls]:
    """A client certificate for ``spiffe://turnstile.local/<path>`` from the local
    stack's CA (beside its ``ca.crt``), in a private temporary directory."""
    ca_cert = ctx.tls.ca
    if ca_cert is None or not (ca_cert.parent / "ca.key").is_file():
        raise DemoError("a tenant's certificate needs the local stack's CA (.run/tls/ca.key)")
    authority = CertificateAuthority.load(ca_cert, ca_cert.parent / "ca.key")
    with tempfile.TemporaryDirectory(prefix="turnstile-demo-") as directory:
        cert, key = Path(directory) / "tenant.crt", Path(directory) / "tenant.key"
        authority.issue(f"spiffe://turnstile.local/{path}", days=1).write(cert, key)
        yield ClientTls(cert=cert, key=key, ca=ca_cert)


def _runtime_pid(sandbox: substrate_pb2.Sandbox) -> int:
    name = sandbox.runtime_name
    if sandbox.substrate != "direct" or not name.startswith("proc-"):
        raise DemoError(
            f"{sandbox.sandbox_id} runs on {sandbox.substrate or 'an unknown substrate'} "
            f"({name or 'no runtime'}): killing a worker needs the local stack"
        )
    pid = int(name.removeprefix("proc-"))
    with contextlib.suppress(OSError):
        command = Path(f"/proc/{pid}/cmdline").read_bytes()
        if b"turnstile-worker" in command or b"turnstile_affinity" in command:
            return pid
    raise DemoError(f"process {pid} is not {sandbox.sandbox_id}'s worker on this host")


async def _reachable(ctx: Context) -> int:
    """Check every service answers SERVING before the story changes anything (the
    key set, limits): a demo against a stack it cannot talk to stops here,
    saying why, instead of after its first change."""
    from turnstile_cli.commands.status import health
    from turnstile_cli.context import SERVICES

    results = await asyncio.gather(*(health(ctx, name) for name in SERVICES))
    problems = [p for _, p in results if p is not None]
    for text in dict.fromkeys(p.text for p in problems):
        ctx.out.failure(text)
    down = [
        f"{name} ({getattr(ctx.targets, name)}: {status})"
        for name, (status, _) in zip(SERVICES, results, strict=True)
        if status != "SERVING"
    ]
    if problems:
        return Exit.TRANSPORT
    if down:
        ctx.out.failure(
            "the stack does not answer: " + ", ".join(down) + "; is `turnstilectl up` running?"
        )
        return Exit.RETRYABLE
    return Exit.OK


async def _demo(args: argparse.Namespace, ctx: Context) -> int:
    unready = await _reachable(ctx)
    if unready != Exit.OK:
        return unready
    provider = tracing.create_tracer_provider("turnstilectl-demo")
    story = Story(
        ctx=Context(
            out=ctx.out,
            targets=ctx.targets,
            timeout_s=ctx.timeout_s,
            tracer_provider=provider,
            tls=ctx.tls,
            stack=ctx.stack,
        ),
        console=ctx.out.console if not ctx.out.json_mode else Console(quiet=True),
        tracer=provider.get_tracer("turnstile_cli.demo"),
        max_wait_s=args.max_wait,
    )
    code: int = Exit.OK
    failure: str | None = None
    try:
        await story.tell()
    except DemoError as error:
        failure, code = str(error), Exit.ERROR
    except (grpc.aio.AioRpcError, TurnstileError) as raw:
        rpc_error = raw if isinstance(raw, TurnstileError) else decode(raw)
        story.refused(rpc_error, "demo step")
        failure, code = f"{rpc_error.code.name}: {rpc_error.message}", Exit.ERROR
    except asyncio.CancelledError:  # Ctrl-C: say why the next seconds are quiet
        ctx.out.err.print(
            "[yellow]interrupted:[/] cleaning up this run's allowlist entries and limits "
            "(a few seconds; its sandboxes stay running)…"
        )
        raise
    finally:
        await _cleanup(story)
        await asyncio.to_thread(_flush, provider)
    payload: dict[str, Any] = {"run": story.run, "steps": story.traces, "completed": code == 0}
    if failure:
        payload["error"] = failure
    ctx.out.emit(payload, lambda console: _summary(console, story, failure))
    return code


async def _cleanup(story: Story) -> None:
    """Remove the run's allowlist entries and limits; its sandboxes stay to look at."""
    with contextlib.suppress(Exception):
        await story.keys(remove=(story.acme, story.globex))
    for key in (story.acme, story.globex):
        with contextlib.suppress(Exception):
            await story.clear_limits(key)


def _fair_line(sandbox_id: str, answer: admission_pb2.AdmitResponse) -> str:
    """An admitted call on one line: what ``admit`` shows of the fair queue
    (:func:`queue_rows`: how long it waited, where it joined and the estimate)."""
    rows: dict[str, object] = {}
    queue_rows(rows, answer)
    said = "; ".join(f"{name} {value}" for name, value in rows.items())
    return f"{sandbox_id} for {answer.key.key}: {said or 'at once, no one waiting'}"


def _flush(provider: TracerProvider) -> None:
    provider.force_flush(5000)
    provider.shutdown()


def _summary(console: Console, story: Story, failure: str | None) -> None:
    console.print()
    if failure:
        console.print(f"[bold red]The story stopped:[/] {escape(failure)}")
    else:
        console.print("[bold green]The end.[/] Look around:")
        for line in (
            "turnstilectl sandboxes",
            "turnstilectl workers",
            f"turnstilectl sessions {story.sandbox('chat-a')} --client {story.acme}",
            f"turnstilectl sessions {story.sandbox('chat-b')} --client {story.globex}",
            f"turnstilectl usage --client {story.acme}",
        ):
            console.print(f"  [cyan]{line}[/]")
    if story.traces:
        exported = tracing.exporter_configured()
        console.print(
            "Traces of each step"
            + (
                " (open http://localhost:16686/trace/<id> in Jaeger):"
                if exported
                else " (the services' spans of each: turnstilectl traces --trace-id <id>):"
            )
        )
        for entry in story.traces:
            console.print(f"  [bold blue]{entry['trace_id']}[/]  {escape(entry['step'])}")
