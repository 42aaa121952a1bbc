"""What a scoped caller learns of the limits every tenant shares (SPEC N5).

The cluster bucket and the nodes' slots sum every tenant's activations: their
capacity and level tell one tenant how busy the others are. A caller scoped to some
clients (:func:`~turnstile_platform.authz.ownership.current_scope` set) is told that
a shared limit refused, or would refuse, as "the cluster is contended, retry in …"
and nothing more; an operator (scope ``any``) and the services themselves still see
every number, as ``GetUsage`` already answers.

One marker carries the distinction across services: a refusal by a shared limit
names it in its ``ErrorInfo`` metadata under :data:`SHARED_LIMIT` (admission's
verdict detail, relayed by the substrate), and a decision-log detail about one
starts with :data:`CONTENDED`. Each service's handler passes what it answers
through :func:`for_caller` (errors) or :func:`detail_for_caller` (log entries), so
an outcome shared between callers (a joined activation) is hidden for each caller
as it is answered.
"""

from __future__ import annotations

import dataclasses
import math

from turnstile_platform.authz.ownership import current_scope
from turnstile_platform.errors import QuotaViolation, RichError

#: What a scoped caller is told of a shared limit, and how a log detail about one starts.
CONTENDED = "the cluster is contended"
#: ``ErrorInfo`` metadata naming the shared limit that refused (``cluster bucket``,
#: ``node slots``): operators read it, and it marks the refusal as one to hide.
SHARED_LIMIT = "shared_limit"
CLUSTER_BUCKET = "cluster bucket"
NODE_SLOTS = "node slots"
#: Metadata a scoped caller never sees in a shared limit's refusal.
_HIDDEN_METADATA = frozenset({"limit", "current", SHARED_LIMIT})


def hidden() -> bool:
    """Whether the call being served is a scoped caller's (shared numbers stay out).
    Meaningful in the handlers of methods that act for a client, where the authorizer
    sets the scope; elsewhere only the services and operators are granted."""
    return current_scope() is not None


def contended(retry_after_s: float | None) -> str:
    """The words a scoped caller gets for a shared limit's refusal."""
    if retry_after_s is None:
        return CONTENDED
    return f"{CONTENDED}, retry in {max(1, math.ceil(retry_after_s - 1e-9))} s"


def scoped(error: RichError) -> RichError:
    """``error`` (a shared limit's refusal) as a scoped caller may read it: its code,
    reason, key and retry hint, without the limit's capacity or level."""
    metadata = {k: v for k, v in error.metadata.items() if k not in _HIDDEN_METADATA}
    return dataclasses.replace(
        error,
        message=contended(error.retry_after_s),
        metadata=metadata,
        quota_violations=(QuotaViolation(subject="cluster", description=CONTENDED),),
    )


def for_caller(error: RichError) -> RichError:
    """``error`` as the call being served may read it: a shared limit's refusal is
    :func:`scoped` for a scoped caller; anything else, or an unscoped caller, as is."""
    if SHARED_LIMIT not in error.metadata or not hidden():
        return error
    return scoped(error)


def log_detail(text: str) -> str:
    """A decision-log detail about a shared limit's refusal (``text``: its full words,
    for operators): marked so that :func:`detail_for_caller` can cut it."""
    return f"{CONTENDED}: {text}"


def detail_for_caller(detail: str) -> str:
    """A decision-log detail as the call being served may read it."""
    if hidden() and detail.startswith(CONTENDED):
        return CONTENDED
    return detail
