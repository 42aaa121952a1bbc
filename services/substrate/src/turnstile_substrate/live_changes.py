"""The changes that bring the published live counts to what a substrate sees.

Both publishers (the Kubernetes leader's, from its reflector, and Direct's,
from its runtime records) write the same store
(:class:`turnstile_clientkeys.live_store.LiveStore`) the same way: the
differences from what Redis holds, in chunks of bounded size.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from turnstile_clientkeys.live_store import Change, Op


def diff(
    desired: dict[str, str], published: dict[str, str], sandboxes: Iterable[str]
) -> list[Change]:
    """The changes that make ``published`` equal ``desired`` for ``sandboxes`` (a
    full resync passes every id either side has)."""
    changes: list[Change] = []
    for sandbox_id in sandboxes:
        want, have = desired.get(sandbox_id), published.get(sandbox_id)
        if want == have:
            continue
        if have is not None:
            changes.append(Change(Op.DEL, sandbox_id, have))
        if want is not None:
            changes.append(Change(Op.SET, sandbox_id, want))
    return changes


def chunks(changes: list[Change], size: int) -> Iterator[list[Change]]:
    """``changes`` in lists of at most ``size`` (one fenced script each)."""
    for start in range(0, len(changes), size):
        yield changes[start : start + size]
