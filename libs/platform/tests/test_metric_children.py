"""Cached metric children: the same series as ``labels()``, and gone when forgotten."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge

from turnstile_platform.metric_children import Children


def test_a_cached_child_is_the_series_labels_would_return() -> None:
    registry = CollectorRegistry()
    calls = Counter("calls_total", "calls", ["method", "code"], registry=registry)
    children = Children(calls)

    children("Admit", "OK").inc()
    children("Admit", "OK").inc()
    children("Admit", "UNAVAILABLE").inc()

    assert children("Admit", "OK") is calls.labels("Admit", "OK")
    assert registry.get_sample_value("calls_total", {"method": "Admit", "code": "OK"}) == 2
    assert registry.get_sample_value("calls_total", {"method": "Admit", "code": "UNAVAILABLE"}) == 1


def test_a_forgotten_child_is_made_again_after_its_series_was_removed() -> None:
    registry = CollectorRegistry()
    pending = Gauge("pending_entries", "pending", ["key"], registry=registry)
    children = Children(pending)
    children("acme").set(3)

    pending.remove("acme")
    children.forget("acme")
    assert registry.get_sample_value("pending_entries", {"key": "acme"}) is None

    children("acme").set(5)
    assert registry.get_sample_value("pending_entries", {"key": "acme"}) == 5
