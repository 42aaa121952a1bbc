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

from turnstile_substrate.kubernetes.settings import KubernetesSettings
from turnstile_substrate.kubernetes.substrate import KubernetesSubstrate

__all__ = ["KubernetesSettings", "KubernetesSubstrate"]
