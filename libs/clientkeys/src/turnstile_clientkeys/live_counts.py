"""Where a bounded key's live sandboxes are kept in Redis: the contract between the
substrate's leader (which writes them from its reflector) and admission (whose
``admit.lua`` reads them inside the decision script, SPEC S4).

Every key shares admission's hash tag (``{adm}``), so the decision script and the
publisher's scripts each touch one slot of a Redis Cluster, and moving a sandbox
from the pending set to the live set is one atomic script.

* ``live:<key>`` — set of the key's live sandbox ids (the reflector's view);
* ``pending:<key>`` — admission's sorted set of admitted, not yet live, sandbox ids;
* ``live-sandboxes`` — hash sandbox id → bounded key of every published id, so a
  pod that goes is removed from the right set and a new leader can diff;
* ``live-epoch`` — the highest leader epoch that has written; older ones are
  refused (fencing). No expiry: a fencing number must outlive any leader;
* ``live-state`` — the marker admission trusts, with a TTL its writer renews:
  :data:`COUNTED` (the counts are current) or :data:`UNSUPPORTED` (this substrate
  cannot count: the cap admits, SPEC S4). Absent: unavailable (no leader, or a
  leader behind): the cap decides on the pending set alone.
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``live-state`` values.
COUNTED = "counted"
UNSUPPORTED = "unsupported"


@dataclass(frozen=True)
class LiveCountKeys:
    prefix: str

    @property
    def base(self) -> str:
        """What every admission key starts with: ``<prefix>{adm}:``."""
        return f"{self.prefix}{{adm}}:"

    def live(self, key: str) -> str:
        return f"{self.base}live:{key}"

    def pending(self, key: str) -> str:
        return f"{self.base}pending:{key}"

    @property
    def sandboxes(self) -> str:
        return f"{self.base}live-sandboxes"

    @property
    def epoch(self) -> str:
        return f"{self.base}live-epoch"

    @property
    def state(self) -> str:
        return f"{self.base}live-state"
