"""Choosing the substrate by settings: ``direct`` (default) or ``kubernetes``.

The Kubernetes substrate is imported only when chosen, so a Direct deployment
never loads kubernetes-asyncio, and a build without
:mod:`turnstile_substrate.kubernetes` still runs Direct.

The Kubernetes package provides ``create_substrate(settings, resolver)``
returning its :class:`~turnstile_substrate.runtime.Substrate`; the resolver is
the service's, kept on the current key set, because the reflector counts live
sandboxes by bounded key.
"""

from __future__ import annotations

import importlib
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, cast

import asyncpg

from turnstile_clientkeys import Resolver
from turnstile_platform.leader import Leadership, LocalLeadership
from turnstile_platform.sandbox_credentials import CredentialIssuer
from turnstile_substrate.admission_client import AdmissionClient
from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.runtime import Substrate
from turnstile_substrate.settings import SubstrateSettings

KUBERNETES_MODULE = "turnstile_substrate.kubernetes"


class SubstrateUnavailableError(RuntimeError):
    """The configured substrate is not part of this build."""


Closer = Callable[[], Awaitable[None]]


class _Factory(Protocol):
    def __call__(
        self,
        settings: SubstrateSettings,
        resolver: Resolver,
        leadership: Leadership | None,
        credentials: CredentialIssuer | None,
        admission: AdmissionClient | None,
    ) -> Substrate: ...


class _LeadershipFactory(Protocol):
    def __call__(self, settings: SubstrateSettings) -> Awaitable[tuple[Leadership, Closer]]: ...


async def _nothing() -> None:
    return None


async def create_leadership(settings: SubstrateSettings) -> tuple[Leadership, Closer]:
    """The process's leader for once-per-cluster work, and what to close after it stops.

    Direct runs its runtimes on one host, as one process: there is nothing to elect, so it
    is always the leader (:class:`LocalLeadership`). Kubernetes runs as several replicas,
    which elect one over a Lease (``TURNSTILE_K8S_LEADER_*``).
    """
    if settings.substrate_kind == "direct":
        return LocalLeadership(), _nothing
    factory = cast(_LeadershipFactory, _kubernetes().create_leadership)
    return await factory(settings)


def create_substrate(
    settings: SubstrateSettings,
    resolver: Resolver,
    leadership: Leadership | None = None,
    credentials: CredentialIssuer | None = None,
    admission: AdmissionClient | None = None,
) -> Substrate:
    """The substrate ``TURNSTILE_SUBSTRATE_KIND`` names (not started yet); its leader-only
    work registers on ``leadership`` (None: it runs its own, as a single replica).
    Kubernetes reserves its warm pods' creation through ``admission`` (SPEC W3).

    ``credentials`` mints sandbox credentials for the runtimes it starts (SPEC Z3):
    Direct writes a file per runtime, Kubernetes a Secret per pod.
    """
    if settings.substrate_kind == "direct":
        return DirectSubstrate(settings, credentials, leadership, resolver)
    factory = cast(_Factory, _kubernetes().create_substrate)
    return factory(settings, resolver, leadership, credentials, admission)


def _kubernetes() -> Any:
    try:
        return importlib.import_module(KUBERNETES_MODULE)
    except ModuleNotFoundError as error:
        if error.name is not None and KUBERNETES_MODULE.startswith(error.name):
            raise SubstrateUnavailableError(
                "TURNSTILE_SUBSTRATE_KIND=kubernetes, but this build has no Kubernetes substrate"
            ) from error
        raise


class _SweepsFactory(Protocol):
    def __call__(
        self,
        substrate: Substrate,
        leadership: Leadership,
        pool: asyncpg.Pool,
        release: Callable[[str], Awaitable[None]],
        database_timeout_s: float,
    ) -> None: ...


def add_sweeps(
    settings: SubstrateSettings,
    substrate: Substrate,
    leadership: Leadership,
    pool: asyncpg.Pool,
    release: Callable[[str], Awaitable[None]],
) -> None:
    """Register the leader's sweeps (SPEC F4) for a started substrate. Direct has none:
    its runtimes are child processes of this one process, which reaps them itself."""
    if settings.substrate_kind == "direct":
        return
    factory = cast(_SweepsFactory, _kubernetes().add_sweeps)
    factory(substrate, leadership, pool, release, settings.database_timeout_s)
