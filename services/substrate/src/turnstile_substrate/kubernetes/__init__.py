"""The Kubernetes substrate: sandbox pods, a reflector with O(1) counts, a warm pool.

Modules, each one concern:

* :mod:`.settings` — ``KubernetesSettings`` (``TURNSTILE_K8S_*``);
* :mod:`.podinfo` — the few pod fields the substrate needs, parsed from raw JSON;
* :mod:`.index` — the cache and its per-client-id / per-bounded-key / warm indexes;
* :mod:`.api` — pod calls over kubernetes-asyncio without client models;
* :mod:`.reflector` — list-then-watch with bookmarks, re-list on 410 and disconnect;
* :mod:`.template` — pod manifests and the adoption patch;
* :mod:`.warmpool` — warm-pool claims (optimistic adoption, invalidation) and refill;
* :mod:`.tasks` — clean-ups that survive their caller's cancellation;
* :mod:`.metrics` — Prometheus metrics (bounded labels);
* :mod:`.substrate` — ``KubernetesSubstrate``, the ``Substrate`` on pods.
"""

from turnstile_clientkeys import Resolver
from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.kubernetes.substrate import KubernetesSubstrate
from turnstile_substrate.runtime import Substrate
from turnstile_substrate.settings import SubstrateSettings

__all__ = ["KubernetesSettings", "KubernetesSubstrate", "create_substrate"]


def create_substrate(settings: SubstrateSettings, resolver: Resolver) -> Substrate:
    """The factory :mod:`turnstile_substrate.substrates` calls when
    ``TURNSTILE_SUBSTRATE_KIND=kubernetes``. The Kubernetes substrate reads its own
    ``TURNSTILE_K8S_*`` settings (invalid ones stop start-up, naming the variable);
    the resolver is the service's, kept on the current key set."""
    del settings  # nothing of the service's own settings shapes pods
    return KubernetesSubstrate(KubernetesSettings(), resolver)
