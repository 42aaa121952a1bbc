"""Cached children of labelled Prometheus metrics, for the hot paths.

``metric.labels(*values)`` validates the values, builds a tuple and takes the
metric's lock on every call; on a path that records several metrics per RPC
that is a measurable share of the handler (docs/performance.md). A child, once
made, stays the same object until the series is removed, so it can be kept:
:class:`Children` keeps them in a plain dict, whose lookup needs no lock (one
event loop per process, and a dict read is atomic under the GIL anyway).

Label values are bounded (SPEC C3: every client label is a bounded key), so the
cache is bounded too. Whoever removes a series (``metric.remove``) must call
:meth:`Children.forget` for it, or the cache would keep a child the registry
no longer exports.
"""

from __future__ import annotations

from typing import Generic, Protocol, TypeVar

Child = TypeVar("Child", covariant=True)


class Labelled(Protocol[Child]):
    def labels(self, *values: str) -> Child: ...


C = TypeVar("C")


class Children(Generic[C]):
    """The children of one labelled metric, looked up once per label values."""

    __slots__ = ("_children", "_metric")

    def __init__(self, metric: Labelled[C]) -> None:
        self._metric = metric
        self._children: dict[tuple[str, ...], C] = {}

    def __call__(self, *values: str) -> C:
        """The child for ``values``, as ``metric.labels(*values)`` would return it."""
        child = self._children.get(values)
        if child is None:
            child = self._children[values] = self._metric.labels(*values)
        return child

    def forget(self, *values: str) -> None:
        """Drop the cached child of ``values`` (call it when removing that series)."""
        self._children.pop(values, None)
