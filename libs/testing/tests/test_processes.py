"""The test kit's port helper never hands the same port out twice, nor one that an
outgoing connection may take as its local end."""

from __future__ import annotations

from turnstile_testing.processes import ephemeral_port_range, free_port


def test_free_port_never_repeats_within_a_process() -> None:
    ports = [free_port() for _ in range(500)]
    assert len(set(ports)) == len(ports)


def test_free_ports_are_outside_the_range_outgoing_connections_take_theirs_from() -> None:
    low, high = ephemeral_port_range()
    ports = [free_port() for _ in range(200)]
    assert not [port for port in ports if low <= port <= high]
