"""The local stack's defaults that ``turnstilectl``'s parser shows in its help: here,
apart from :mod:`.config`, so that parsing imports no more than it needs (``--help``
and usage errors stay instant, docs/cli.md)."""

from __future__ import annotations

#: Tiers of the local stack: two, so placement inside a tier can be seen.
LOCAL_TIERS = "container,microvm"

#: The local stack's grace period: short, so a killed worker's sessions fall
#: back within the demo (production default: 60 s).
LOCAL_GRACE_S = 10.0
