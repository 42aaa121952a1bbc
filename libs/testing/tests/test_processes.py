"""The test kit's port helper never hands the same port out twice."""

from __future__ import annotations

from turnstile_testing.processes import free_port


def test_free_port_never_repeats_within_a_process() -> None:
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)
