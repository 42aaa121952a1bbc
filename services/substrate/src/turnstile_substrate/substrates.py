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
from typing import Protocol, cast

from turnstile_clientkeys import Resolver
from turnstile_substrate.direct.substrate import DirectSubstrate
from turnstile_substrate.runtime import Substrate
from turnstile_substrate.settings import SubstrateSettings

KUBERNETES_MODULE = "turnstile_substrate.kubernetes"


class SubstrateUnavailableError(RuntimeError):
    """The configured substrate is not part of this build."""


class _Factory(Protocol):
    def __call__(self, settings: SubstrateSettings, resolver: Resolver) -> Substrate: ...


def create_substrate(settings: SubstrateSettings, resolver: Resolver) -> Substrate:
    """The substrate ``TURNSTILE_SUBSTRATE_KIND`` names (not started yet)."""
    if settings.substrate_kind == "direct":
        return DirectSubstrate(settings)
    try:
        module = importlib.import_module(KUBERNETES_MODULE)
    except ModuleNotFoundError as error:
        if error.name is not None and KUBERNETES_MODULE.startswith(error.name):
            raise SubstrateUnavailableError(
                "TURNSTILE_SUBSTRATE_KIND=kubernetes, but this build has no Kubernetes substrate"
            ) from error
        raise
    factory = cast(_Factory, module.create_substrate)
    return factory(settings, resolver)
