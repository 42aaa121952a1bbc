"""``KubernetesSubstrate``: the :class:`~turnstile_substrate.runtime.Substrate` on pods.

* counts come from the reflector's index (O(1), SPEC S3/S4); before its first
  list they are unknown and :meth:`ready` is False;
* a runtime is a pod labelled with its sandbox id and — set at creation, never
  changed — the activating client's id (SPEC S2);
* :meth:`ensure_runtime` runs the cap gate before every pod it makes the
  sandbox's: each warm adoption and each cold create (SPEC S5, P1); it claims
  warm pods first when the plan says so, then falls back to a cold create, and
  on failure leaves nothing behind.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Collection

import asyncpg
from kubernetes_asyncio import client as k8s

from turnstile_clientkeys import Resolver
from turnstile_clientkeys.live_store import LiveStore
from turnstile_platform.background import BackgroundTasks
from turnstile_platform.dependencies import DEPENDENCY_ERRORS
from turnstile_platform.leader import Leadership, LeaderTerm, LocalLeadership
from turnstile_platform.sandbox_credentials import CredentialIssuer
from turnstile_substrate.admission_client import AdmissionClient
from turnstile_substrate.kubernetes import metrics, template
from turnstile_substrate.kubernetes.api import KubeApiError, PodsApi, connect
from turnstile_substrate.kubernetes.credentials import CredentialDelivery, SecretsApi
from turnstile_substrate.kubernetes.index import PodIndex
from turnstile_substrate.kubernetes.live_publisher import LivePublisher
from turnstile_substrate.kubernetes.podinfo import PodInfo
from turnstile_substrate.kubernetes.reflector import Reflector
from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.kubernetes.sweeps import Release, Sweeper
from turnstile_substrate.kubernetes.warm_admission import RefillAdmission
from turnstile_substrate.kubernetes.warmpool import AdoptionFailedError, WarmPool
from turnstile_substrate.runtime import (
    LABEL_SANDBOX_ID,
    CapGate,
    CountUnknown,
    CreateKind,
    LiveCount,
    Plan,
    Runtime,
    RuntimeSpec,
)

log = logging.getLogger(__name__)

#: Failed warm adoptions one activation tolerates before it creates cold; each
#: failure has already discarded its pod, so this only bounds the latency.
MAX_WARM_ATTEMPTS = 3


#: Creates of one deterministic pod name per activation: a name held by an earlier
#: attempt's pod that is going away is tried again once it has gone.
_CREATE_ATTEMPTS = 3


class KubernetesSubstrate:
    """Sandbox runtimes as pods in one namespace."""

    name = "kubernetes"

    def __init__(
        self,
        settings: KubernetesSettings,
        resolver: Resolver,
        *,
        api_client: k8s.ApiClient | None = None,
        leadership: Leadership | None = None,
        credentials: CredentialIssuer | None = None,
        credential_renew_interval_s: float = 300.0,
        admission: AdmissionClient | None = None,
    ) -> None:
        """``api_client`` is used as given and not closed; without one, :meth:`start`
        connects per ``settings`` and :meth:`close` closes the connection.

        ``credentials``: sandbox credentials are delivered in per-pod Secrets (SPEC Z3,
        :mod:`.credentials`) and renewed every ``credential_renew_interval_s`` as leader
        work; None delivers none (a relay with attestation off).

        Leader-only work (the warm-pool refill and trim) registers on ``leadership``, which
        its owner runs; without one the substrate runs a :class:`LocalLeadership` of its own
        (a single replica: it always leads).

        ``admission``: the warm-pool refill reserves each pod's creation through it
        (``warm_refill_admitted``, SPEC W3); None: the tiers' sizes alone bound it."""
        self.settings = settings
        self._admission = admission
        self._resolver = resolver
        self._api_client = api_client
        self._owns_client = api_client is None
        self.index = PodIndex(resolver, on_warm_change=self._warm_changed)
        self._publisher: LivePublisher | None = None
        self._api: PodsApi | None = None
        self._reflector: Reflector | None = None
        self._pool: WarmPool | None = None
        self._nodes = tuple(settings.nodes)
        #: pods stop_runtime deleted that the cache may still show (until the reflector
        #: sees them go), so find_running does not answer with a pod just stopped
        self._stopped: set[str] = set()
        # On every replica: the clean-ups of its own cancelled calls.
        self._cleanups = BackgroundTasks("kubernetes substrate clean-ups")
        self._leadership = leadership
        # With no elector given this replica leads alone (one replica, or tests).
        self._local_leader = BackgroundTasks("kubernetes substrate local leadership")
        self._issuer = credentials
        self._renew_interval_s = credential_renew_interval_s
        self.credentials: CredentialDelivery | None = None

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        if self._api_client is None:
            self._api_client = await connect(self.settings)
        self._api = PodsApi(self._api_client, self.settings)
        self._reflector = Reflector(self._api, self.index, self.settings)
        self._pool = WarmPool(
            self._api,
            self.index,
            self.settings,
            self._reflector.synced,
            credentials=self._issuer is not None,
            admission=self._refill_admission(),
        )
        self.index.on_demand = self._pool.record_demand
        if self._issuer is not None:
            self.credentials = CredentialDelivery(
                SecretsApi(self._api_client, self.settings),
                self._issuer,
                self.index,
                self.settings,
                self._reflector.synced,
                renew_interval_s=self._renew_interval_s,
            )
        self._reflector.start()
        leadership = self._leadership
        if leadership is None:
            leadership = LocalLeadership()
            self._local_leader.spawn(leadership.run(), name="k8s-local-leader")
        leadership.add_work("warm-pool", self._pool.run)
        if self.credentials is not None:
            leadership.add_work("sandbox-credential-renewal", self.credentials.run)

    def _refill_admission(self) -> RefillAdmission | None:
        if self._admission is None or not self.settings.warm_refill_admitted:
            return None
        return RefillAdmission(
            self._admission,
            self._nodes,
            unavailable_backoff_s=max(1.0, self.settings.warm_pool_interval_s),
        )

    async def close(self) -> None:
        await self._local_leader.close()
        if self._pool is not None:
            await self._pool.stop()
        if self._reflector is not None:
            await self._reflector.stop()
        await self._cleanups.wait()
        if self._owns_client and self._api_client is not None:
            await self._api_client.close()
            self._api_client = None

    def ready(self) -> bool:
        return self._reflector is not None and self._reflector.synced.is_set()

    async def wait_synced(self, timeout: float | None = None) -> None:
        """Wait for the reflector's first list (tests, and start-up probes)."""
        await self.reflector.wait_synced(timeout)

    @property
    def reflector(self) -> Reflector:
        if self._reflector is None:
            raise RuntimeError("the Kubernetes substrate is not started")
        return self._reflector

    @property
    def pool(self) -> WarmPool:
        if self._pool is None:
            raise RuntimeError("the Kubernetes substrate is not started")
        return self._pool

    def sweeper(
        self, pool: asyncpg.Pool, release: Release, *, database_timeout_s: float = 5.0
    ) -> Sweeper:
        """The sweeps over this substrate's pods and ``pool``'s records (after :meth:`start`);
        register its ``run`` as leader work."""
        return Sweeper(
            self.api,
            self.index,
            self.settings,
            self.reflector.synced,
            pool,
            release,
            database_timeout_s=database_timeout_s,
        )

    @property
    def api(self) -> PodsApi:
        if self._api is None:
            raise RuntimeError("the Kubernetes substrate is not started")
        return self._api

    # ------------------------------------------------------------------ Substrate

    async def find_running(self, sandbox_id: str) -> Runtime | None:
        """The sandbox's live pod: from the cache, else from the API server.

        A miss in the cache is confirmed with a list by label, because the
        reflector may not have seen a pod created a moment ago; a running
        sandbox must never be created twice nor refused (SPEC S5).
        """
        for pod in self.index.live_pods(sandbox_id):
            if pod.name not in self._stopped:
                return _runtime(pod, CreateKind.COLD)
        for pod in await self.api.list_selected(self._sandbox_selector(sandbox_id)):
            if pod.live:
                return _runtime(pod, CreateKind.COLD)
        return None

    def plan(self, spec: RuntimeSpec) -> Plan:
        if spec.restore:
            return Plan(CreateKind.RESTORE, self._nodes)
        if self._pool is not None and self._pool.claimable(spec.tier) is not None:
            return Plan(CreateKind.WARM)
        return Plan(CreateKind.COLD, self._nodes)

    async def ensure_runtime(self, spec: RuntimeSpec, plan: Plan, cap_gate: CapGate) -> Runtime:
        if plan.kind is CreateKind.WARM:
            runtime = await self._claim_warm(spec, cap_gate)
            if runtime is not None:
                return runtime
        kind = CreateKind.RESTORE if spec.restore else CreateKind.COLD
        return await self._create(spec, kind, cap_gate)

    async def stop_runtime(self, sandbox_id: str) -> bool:
        """Revoke the sandbox's credential, then delete every pod of the sandbox (as the API
        server knows them) and its credential Secrets.

        The revocation comes first; when Redis cannot be reached the pods and Secrets are
        deleted all the same, then ``UNAVAILABLE`` tells the caller to retry the revocation."""
        unrevoked: BaseException | None = None
        if self.credentials is not None:
            try:
                await self.credentials.issuer.revoke(sandbox_id)
            except DEPENDENCY_ERRORS as error:
                unrevoked = error
            await self.credentials.delete_secrets(sandbox_id)
        stopped = False
        for pod in await self.api.list_selected(self._sandbox_selector(sandbox_id)):
            if pod.deleting:
                continue
            if await self.api.delete(pod.name, uid=pod.uid) and pod.live:
                stopped = True
            self._stopped.add(pod.name)
        self._stopped.intersection_update(self.index.pods)
        if unrevoked is not None:
            log.warning("could not revoke a stopped runtime's credential: %s", unrevoked)
            raise unrevoked
        return stopped

    def count_live(
        self, key: str, exclude_sandbox_id: str | None, pending: Collection[str]
    ) -> LiveCount | CountUnknown:
        if not self.ready():
            return CountUnknown("not_synced", "the pod reflector has not finished its first list")
        live, live_pending = self.index.count_live(key, exclude_sandbox_id, pending)
        return LiveCount(live, live_pending)

    def key_set_changed(self) -> None:
        """Wake the live publisher: its next pass re-keys the pod index and publishes
        what moved at once, rather than at its next renewal (a third of the live
        counts' ttl), so a client just given a key of its own has its cap count its
        pods from its next activation on. On a replica that does not lead, nothing
        runs to wake."""
        if self._publisher is not None:
            self._publisher.wake()

    def live_counts_work(
        self, store: LiveStore, chunk: int
    ) -> Callable[[LeaderTerm], Awaitable[None]]:
        """Leader-only: publish the reflector's live sandboxes per bounded key."""
        self._publisher = LivePublisher(store, self.index, self.reflector, chunk=chunk)
        return self._publisher.run

    # ------------------------------------------------------------------ internals

    async def _claim_warm(self, spec: RuntimeSpec, cap_gate: CapGate) -> Runtime | None:
        """Adopt the next warm pod of the tier; None when none could be adopted."""
        pool = self.pool
        for _ in range(MAX_WARM_ATTEMPTS):
            pod = pool.reserve(spec.tier)
            if pod is None:
                return None
            try:
                await cap_gate()
            except BaseException:
                pool.release(pod)
                raise
            if self.credentials is not None:
                try:
                    await self._deliver(pod.name, spec, pod_uid=pod.uid, pod_ip=pod.ip)
                except KubeApiError as error:
                    if error.conflict:
                        # Another claim is writing this pod's Secret: the pod is its, not ours.
                        pool.skip(pod)
                        continue
                    pool.release(pod)
                    raise
                except BaseException:
                    pool.release(pod)
                    await self._cleanups.shielded(self._remove_secret(pod.name, spec.sandbox_id))
                    raise
            try:
                adopted = await pool.adopt(pod, spec)
            except AdoptionFailedError as error:
                log.info("warm claim for sandbox %s failed: %s", spec.sandbox_id, error)
                await self._cleanups.shielded(self._remove_secret(pod.name, spec.sandbox_id))
                continue
            except BaseException:
                await self._cleanups.shielded(self._remove_secret(pod.name, spec.sandbox_id))
                raise
            return _runtime(adopted, CreateKind.WARM)
        return None

    async def _create(self, spec: RuntimeSpec, kind: CreateKind, cap_gate: CapGate) -> Runtime:
        try:
            await cap_gate()
        except BaseException:
            metrics.COLD_CREATES.labels(tier=spec.tier, result="refused").inc()
            raise
        body = template.sandbox_pod(self.settings, spec, credentials=self.credentials is not None)
        name = body["metadata"]["name"]
        if self.credentials is not None:
            # Before the pod, so the kubelet mounts it when it starts the pod. A failure
            # here leaves no pod; the activation's compensation revokes and deletes.
            try:
                await self._deliver(name, spec)
            except BaseException:
                metrics.COLD_CREATES.labels(tier=spec.tier, result="failed").inc()
                raise
        for attempt in range(_CREATE_ATTEMPTS):
            try:
                pod = await self.api.create(body)
            except KubeApiError as error:
                if error.conflict:
                    more = attempt < _CREATE_ATTEMPTS - 1
                    if more and await self._terminating_then_gone(name, spec):
                        continue  # an earlier attempt's pod has gone: the name is free again
                    # The name is this activation's: an earlier attempt (a timed-out create
                    # that landed, another replica) made it. The same runtime, not a second.
                    existing = await self._same_activation(name, spec)
                    metrics.COLD_CREATES.labels(tier=spec.tier, result="already_exists").inc()
                    return _runtime(existing, kind)
                metrics.COLD_CREATES.labels(tier=spec.tier, result="failed").inc()
                if not 400 <= error.status < 500:
                    # The outcome is unknown (5xx): the pod may exist.
                    await self._cleanups.shielded(self._remove_created(name, spec.sandbox_id))
                raise
            except BaseException:
                metrics.COLD_CREATES.labels(tier=spec.tier, result="failed").inc()
                # The outcome is unknown (timeout, cancelled): the pod may exist.
                await self._cleanups.shielded(self._remove_created(name, spec.sandbox_id))
                raise
            break
        metrics.COLD_CREATES.labels(tier=spec.tier, result="created").inc()
        return _runtime(pod, kind)

    async def _terminating_then_gone(self, name: str, spec: RuntimeSpec) -> bool:
        """Whether the pod holding this activation's name was an earlier attempt's that
        is being deleted (its compensation ran: the client gave up, the retry came at
        once) and has now gone, so the name can be used again; also when the pod is
        already gone by the time it is read (a refused create, then a 404).

        Waits for the reflector to see it go, at most its termination grace plus one
        request timeout; a pod that outlasts that is answered as before (retryable).
        """
        reflector = self._reflector
        pod = await self.api.get(name)
        if pod is None:
            return True  # gone between the refused create and this read: free again
        if reflector is None or pod.sandbox_id != spec.sandbox_id:
            return False
        if not pod.deleting:
            return False
        bound = self.settings.termination_grace_s + self.settings.request_timeout_s
        try:
            await reflector.wait_until(lambda: name not in self.index.pods, timeout=bound)
        except TimeoutError:
            return False
        return True

    async def _same_activation(self, name: str, spec: RuntimeSpec) -> PodInfo:
        """The pod that holds this activation's name, if it is the sandbox's live runtime."""
        pod = await self.api.get(name)
        if pod is None or pod.sandbox_id != spec.sandbox_id or not pod.live:
            # Gone again, or still terminating (an earlier attempt's compensation): the
            # caller's retry will find it gone or running.
            state = "gone" if pod is None else "terminating" if pod.deleting else pod.phase
            raise KubeApiError(409, "AlreadyExists", f"pod {name} exists but is {state}")
        return pod

    async def _remove_created(self, name: str, sandbox_id: str) -> None:
        """Delete a pod this call may have created; never raises."""
        try:
            obj = await self.api.read(name)
            if obj is None:
                return
            meta = obj["metadata"]
            if (meta.get("labels") or {}).get(LABEL_SANDBOX_ID) == sandbox_id:
                await self.api.delete(name, uid=meta.get("uid"))
        except Exception as error:
            log.warning("cleaning up pod %s after a failed create failed: %s", name, error)

    async def _deliver(
        self, pod_name: str, spec: RuntimeSpec, *, pod_uid: str = "", pod_ip: str = ""
    ) -> None:
        """Write the pod's credential Secret; a failing Redis goes on to the caller
        (the interceptor answers ``UNAVAILABLE``; nothing was made: the record is
        written before the Secret)."""
        assert self.credentials is not None
        await self.credentials.deliver(pod_name, spec, pod_uid=pod_uid, pod_ip=pod_ip)

    async def _remove_secret(self, pod_name: str, sandbox_id: str) -> None:
        """Delete the credential Secret a failed warm claim wrote; never raises."""
        if self.credentials is None:
            return
        try:
            await self.credentials.remove_for_pod(pod_name, sandbox_id)
        except Exception as error:
            log.warning("removing the credential Secret of pod %s failed: %s", pod_name, error)

    def _sandbox_selector(self, sandbox_id: str) -> str:
        return f"{self.settings.label_selector},{LABEL_SANDBOX_ID}={sandbox_id}"

    def _warm_changed(self) -> None:
        if self._pool is not None:
            self._pool.wake()


def _runtime(pod: PodInfo, kind: CreateKind) -> Runtime:
    return Runtime(
        sandbox_id=pod.sandbox_id or "",
        name=pod.name,
        kind=kind,
        client_label=pod.client_label,
        tier=pod.tier,
        node=pod.node,
        creation_paid=kind is CreateKind.WARM and pod.paid,
    )
