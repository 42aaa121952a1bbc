"""Fixtures of the substrate's tests: a migrated database, a stand-in admission
service, and the substrate service itself, all over real connections.

The admission service is built in parallel with this one, so these tests run
against :class:`AdmissionDouble`: a small AdmissionService of the tests' own,
served by grpc.aio on a real socket, with a plain counter cap (a sandbox counts
against its key from Admit until its hold is cancelled or the sandbox is
released). The real cross-service path is tested where the services meet.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import grpc
import grpc.aio
import pytest
from google.protobuf import duration_pb2

from turnstile_clientkeys import KeySet, Resolver, is_label_value
from turnstile_contracts import (
    admission_pb2,
    admission_pb2_grpc,
    common_pb2,
    substrate_pb2,
    substrate_pb2_grpc,
)
from turnstile_platform.errors import RichError, decode
from turnstile_platform.leader import Leadership
from turnstile_platform.sandbox_credentials import CredentialIssuer
from turnstile_platform.server import GrpcService
from turnstile_substrate.app import create_app
from turnstile_substrate.db.migrate import apply_migrations
from turnstile_substrate.kubernetes import KubernetesSettings, KubernetesSubstrate
from turnstile_substrate.settings import SubstrateSettings
from turnstile_testing.kube_emulator import KubeEmulator

IDLE_RUNTIME = f"{sys.executable} -m turnstile_substrate.direct.idle_runtime"

Context = grpc.aio.ServicerContext[Any, Any]


# -- the stand-in admission service ---------------------------------------------


@dataclass
class Hold:
    hold_id: str
    sandbox_id: str
    key: str
    state: str = "held"  # held | committed | cancelled | released


@dataclass
class AdmissionDouble(admission_pb2_grpc.AdmissionServiceServicer):
    """AdmissionService with a counter cap per key, recording every call."""

    cap: int = 10
    address: str = ""
    holds: dict[str, Hold] = field(default_factory=dict)
    admits: list[admission_pb2.AdmitRequest] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    usage_calls: int = 0
    #: Awaited inside Admit before it decides (a fault a test injects).
    on_admit: Callable[[], Awaitable[None]] | None = None
    #: Answered by Admit instead of deciding.
    answer: admission_pb2.AdmitResponse | None = None
    #: The cap verdict's mode and verdict in admitted answers.
    cap_mode: admission_pb2.PolicyMode.ValueType = admission_pb2.POLICY_MODE_ENFORCE
    cap_verdict: admission_pb2.Verdict.ValueType = admission_pb2.VERDICT_PASS
    #: Extra pending entries GetUsage reports (another activation's, say).
    extra_pending: int = 0
    #: GetUsage answers without a live count (the count is unavailable).
    live_unavailable: bool = False

    @staticmethod
    def key_of(client: common_pb2.ActivationClient) -> str:
        form = client.WhichOneof("client")
        if form == "client_id":
            return client.client_id if is_label_value(client.client_id) else "shared"
        assert form in ("native", "unattributed"), f"admission got {form}"
        return form

    def charged(self, key: str) -> set[str]:
        """Sandboxes counted against ``key``: admitted, not cancelled or released."""
        return {
            h.sandbox_id
            for h in self.holds.values()
            if h.key == key and h.state in ("held", "committed")
        }

    def in_state(self, state: str) -> list[Hold]:
        return [h for h in self.holds.values() if h.state == state]

    async def Admit(
        self, request: admission_pb2.AdmitRequest, context: Context
    ) -> admission_pb2.AdmitResponse:
        self.admits.append(request)
        if self.on_admit is not None:
            await self.on_admit()
        if self.answer is not None:
            return self.answer
        key = self.key_of(request.client)
        bounded = common_pb2.BoundedKey(key=key, kind=common_pb2.KEY_KIND_OWN, key_set_version=1)
        others = self.charged(key) - {request.sandbox_id}
        if len(others) >= self.cap:
            return admission_pb2.AdmitResponse(
                decision=admission_pb2.DECISION_REFUSED,
                key=bounded,
                refused_by=admission_pb2.POLICY_CAP,
                limit=self.cap,
                current=len(others),
                retry_after=duration_pb2.Duration(seconds=2),
                verdicts=[
                    admission_pb2.PolicyVerdict(
                        policy=admission_pb2.POLICY_CAP,
                        mode=admission_pb2.POLICY_MODE_ENFORCE,
                        verdict=admission_pb2.VERDICT_REFUSE,
                        limit=self.cap,
                        current=len(others),
                    )
                ],
                message=f"cap of {self.cap} reached",
            )
        hold = Hold(uuid.uuid4().hex, request.sandbox_id, key)
        self.holds[hold.hold_id] = hold
        return admission_pb2.AdmitResponse(
            decision=admission_pb2.DECISION_ADMITTED,
            hold_id=hold.hold_id,
            key=bounded,
            verdicts=[
                admission_pb2.PolicyVerdict(
                    policy=admission_pb2.POLICY_CAP,
                    mode=self.cap_mode,
                    verdict=self.cap_verdict,
                    limit=self.cap,
                    current=len(others),
                )
            ],
        )

    async def CommitHold(
        self, request: admission_pb2.CommitHoldRequest, context: Context
    ) -> admission_pb2.CommitHoldResponse:
        hold = self.holds.get(request.hold_id)
        if hold is None or hold.state != "held":
            return admission_pb2.CommitHoldResponse(committed=False)
        hold.state = "committed"
        return admission_pb2.CommitHoldResponse(committed=True)

    async def ReserveWarm(
        self, request: admission_pb2.ReserveWarmRequest, context: Context
    ) -> admission_pb2.ReserveWarmResponse:
        # The warm-pool refill through admission is tested against the real service
        # (tests/e2e/test_e2e_warm_admission.py); this double keeps no reservations.
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, "not in the admission double")
        raise AssertionError("abort raises")

    async def CancelHold(
        self, request: admission_pb2.CancelHoldRequest, context: Context
    ) -> admission_pb2.CancelHoldResponse:
        hold = self.holds.get(request.hold_id)
        if hold is None or hold.state != "held":
            return admission_pb2.CancelHoldResponse(cancelled=False)
        hold.state = "cancelled"
        return admission_pb2.CancelHoldResponse(cancelled=True)

    async def ReleaseSandbox(
        self, request: admission_pb2.ReleaseSandboxRequest, context: Context
    ) -> admission_pb2.ReleaseSandboxResponse:
        self.released.append(request.sandbox_id)
        held = [h for h in self.holds.values() if h.sandbox_id == request.sandbox_id]
        for hold in held:
            if hold.state == "committed":
                hold.state = "released"
        return admission_pb2.ReleaseSandboxResponse(released=bool(held))

    async def GetUsage(
        self, request: admission_pb2.GetUsageRequest, context: Context
    ) -> admission_pb2.GetUsageResponse:
        self.usage_calls += 1
        key = self.key_of(request.client)
        mine = [h for h in self.holds.values() if h.key == key]
        usage = admission_pb2.GetUsageResponse(
            key=common_pb2.BoundedKey(key=key, kind=common_pb2.KEY_KIND_OWN, key_set_version=1),
            pending=sum(h.state == "held" for h in mine) + self.extra_pending,
            cap=self.cap,
        )
        if not self.live_unavailable:
            usage.live = sum(h.state == "committed" for h in mine)
        return usage

    async def ListDecisions(
        self, request: admission_pb2.ListDecisionsRequest, context: Context
    ) -> admission_pb2.ListDecisionsResponse:
        return admission_pb2.ListDecisionsResponse()

    async def GetQueuePosition(
        self, request: admission_pb2.GetQueuePositionRequest, context: Context
    ) -> admission_pb2.GetQueuePositionResponse:
        return admission_pb2.GetQueuePositionResponse(state=admission_pb2.QUEUE_STATE_NOT_FOUND)


@pytest.fixture
async def admission() -> AsyncIterator[AdmissionDouble]:
    """The stand-in admission service, listening on a free port."""
    double = AdmissionDouble()
    server = grpc.aio.server()
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(double, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    double.address = f"127.0.0.1:{port}"
    try:
        yield double
    finally:
        await server.stop(None)


# -- database --------------------------------------------------------------------


async def migrate(database_url: str, upto: str | None = None) -> list[str]:
    """Apply the migrations (yoyo is synchronous: run it off the event loop)."""
    return await asyncio.to_thread(apply_migrations, database_url, upto=upto)


@pytest.fixture
async def migrated_url(database_url: str) -> str:
    """A fresh database with the substrate's schema."""
    await migrate(database_url)
    return database_url


@pytest.fixture
async def pool(migrated_url: str) -> AsyncIterator[asyncpg.Pool]:
    """A plain asyncpg pool on the migrated database."""
    db = await asyncpg.create_pool(migrated_url, min_size=1, max_size=4)
    try:
        yield db
    finally:
        await db.close()


# -- the substrate service -------------------------------------------------------


def runtime_pids(state_dir: Path) -> dict[str, int]:
    """Live runtime processes under ``state_dir``, by sandbox id: every process
    whose working directory is a sandbox workspace there, found through /proc
    (the truth, whatever the substrate believes)."""
    found: dict[str, int] = {}
    root = str(state_dir.absolute())
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            cwd = os.readlink(f"/proc/{entry.name}/cwd")
        except OSError:
            continue
        if cwd.startswith(root + os.sep) and cwd.endswith(f"{os.sep}workspace"):
            found[Path(cwd).parent.name] = int(entry.name)
    return found


def kill_runtimes(state_dir: Path) -> None:
    """Kill every runtime process group left under ``state_dir``."""
    for pid in runtime_pids(state_dir).values():
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def substrate_settings(
    database_url: str, admission: AdmissionDouble, state_dir: Path, redis_prefix: str, **extra: Any
) -> SubstrateSettings:
    values: dict[str, Any] = {
        "host": "127.0.0.1",
        "port": 0,
        "metrics_port": 0,
        "database_url": database_url,
        "database_pool_max": 20,
        "admission_addr": admission.address,
        "redis_prefix": redis_prefix,
        "substrate_kind": "direct",
        "direct_runtime_command": IDLE_RUNTIME,
        "direct_runtime_user": str(os.getuid()),
        "direct_state_dir": state_dir,
        "direct_stop_grace_s": 5.0,
        "shutdown_grace_s": 1.0,
        "health_check_interval_s": 0.2,
        "log_format": "text",
    }
    values.update(extra)
    return SubstrateSettings(**values)


@dataclass
class Harness:
    """A running substrate service and what the tests look at around it."""

    app: GrpcService
    stub: substrate_pb2_grpc.SubstrateServiceAsyncStub
    admission: AdmissionDouble
    settings: SubstrateSettings
    database_url: str
    channel: grpc.aio.Channel

    @property
    def state_dir(self) -> Path:
        return self.settings.direct_state_dir

    async def activate(
        self, sandbox_id: str, client: common_pb2.ActivationClient | str, tier: str = ""
    ) -> substrate_pb2.ActivateResponse:
        message = (
            common_pb2.ActivationClient(client_id=client) if isinstance(client, str) else client
        )
        return await self.stub.Activate(
            substrate_pb2.ActivateRequest(sandbox_id=sandbox_id, client=message, tier=tier)
        )

    def processes(self) -> dict[str, int]:
        return runtime_pids(self.state_dir)

    async def rows(self, query: str, *args: object) -> list[asyncpg.Record]:
        conn = await asyncpg.connect(self.database_url)
        try:
            return await conn.fetch(query, *args)
        finally:
            await conn.close()

    @staticmethod
    async def error(call: Awaitable[object]) -> RichError:
        """The rich error a call fails with (the test fails if it succeeds)."""
        try:
            await call
        except grpc.aio.AioRpcError as error:
            return decode(error)
        raise AssertionError("the call succeeded")

    @staticmethod
    def inherit() -> common_pb2.ActivationClient:
        return common_pb2.ActivationClient(inherit=common_pb2.ActivationClient.Inherit())

    @staticmethod
    def native() -> common_pb2.ActivationClient:
        return common_pb2.ActivationClient(native=common_pb2.ActivationClient.Native())


StartService = Callable[..., Awaitable[Harness]]


@pytest.fixture
def state_dir(tmp_path: Path) -> Iterator[Path]:
    """The Direct substrate's state directory; runtimes left in it are killed after."""
    directory = tmp_path / "direct"
    try:
        yield directory
    finally:
        kill_runtimes(directory)


@pytest.fixture
async def start_service(
    admission: AdmissionDouble, state_dir: Path, redis_prefix: str
) -> AsyncIterator[StartService]:
    """Starts substrate services (Direct, idle runtimes) with settings overrides;
    each is stopped after the test."""
    started: list[Harness] = []

    async def start(database_url: str, **overrides: Any) -> Harness:
        settings = substrate_settings(database_url, admission, state_dir, redis_prefix, **overrides)
        app = await create_app(settings)
        await app.start()
        channel = grpc.aio.insecure_channel(app.address)
        stub = substrate_pb2_grpc.SubstrateServiceStub(channel)
        harness = Harness(app, stub, admission, settings, database_url, channel)
        started.append(harness)
        return harness

    try:
        yield start
    finally:
        for harness in started:
            await harness.channel.close(None)
            await harness.app.stop()


@pytest.fixture
async def harness(migrated_url: str, start_service: StartService) -> Harness:
    """A substrate service on a migrated database of its own."""
    return await start_service(migrated_url)


# -- the Kubernetes substrate on the API-server emulator -----------------------

K8S_NAMESPACE = "sandboxes"

StartSubstrate = Callable[..., contextlib.AbstractAsyncContextManager[KubernetesSubstrate]]


@pytest.fixture
async def kube() -> AsyncIterator[KubeEmulator]:
    """An API-server emulator of this test's own, with quick bookmarks, graceful deletion of
    scheduled pods, and the sandbox namespace's ``restricted`` Pod Security level enforced on
    every pod the substrate creates (test seeding through ``kube.create_pod`` is exempt)."""
    async with KubeEmulator(
        bookmark_interval=0.05, graceful_deletion=True, pod_security="restricted"
    ) as emulator:
        yield emulator


@pytest.fixture
def substrate() -> StartSubstrate:
    """``substrate(kube, leadership=None, credentials=None, resolver=None, **settings)``: a
    started, synced Kubernetes substrate on ``kube`` with quick timings (``acme`` allowlisted
    unless ``resolver`` says otherwise), closed on exit; its leader-only work registers on
    ``leadership`` (None: it always leads); ``credentials`` delivers sandbox credentials in
    Secrets."""

    @contextlib.asynccontextmanager
    async def start(
        kube: KubeEmulator,
        *,
        leadership: Leadership | None = None,
        credentials: CredentialIssuer | None = None,
        credential_renew_interval_s: float = 300.0,
        resolver: Resolver | None = None,
        **overrides: Any,
    ) -> AsyncIterator[KubernetesSubstrate]:
        settings: dict[str, Any] = {
            "api_host": kube.url,
            "namespace": K8S_NAMESPACE,
            "relist_backoff_s": 0.01,
            "relist_backoff_max_s": 0.05,
            "warm_pool_interval_s": 0.05,
            "warm_require_running": False,
            # claims take the oldest warm pod, so a test knows which one it contests
            "warm_claim_spread": 1,
            **overrides,
        }
        sub = KubernetesSubstrate(
            KubernetesSettings(**settings),
            resolver or Resolver(KeySet(version=1, allowlist=frozenset({"acme"}))),
            leadership=leadership,
            credentials=credentials,
            credential_renew_interval_s=credential_renew_interval_s,
        )
        await sub.start()
        try:
            await sub.wait_synced(5)
            yield sub
        finally:
            await sub.close()

    return start
