"""Before starting anything: tiers valid, commands present, ports free, Redis and
PostgreSQL answering, the database there and migrated."""

from __future__ import annotations

import asyncio
import socket
from dataclasses import replace
from urllib.parse import urlsplit, urlunsplit

import asyncpg

from turnstile_cli.stack.config import StackConfig, find_command
from turnstile_cli.stack.logs import LogPrinter
from turnstile_platform.redis_client import create_redis
from turnstile_platform.tiers import TierConfigError, parse_tiers


class PreflightError(Exception):
    """The stack cannot start; the message says what to do."""


def redacted(url: str) -> str:
    """``url`` without its password, for printing."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def check_tiers(config: StackConfig) -> None:
    try:
        parse_tiers(config.tiers, config.default_tier)
    except TierConfigError as error:
        raise PreflightError(f"tier configuration: {error}") from None


def check_commands(config: StackConfig) -> None:
    missing = [
        name
        for name in [s.command for s in config.services()]
        + ["turnstile-migrate", "turnstile-worker"]
        if find_command(name) is None
    ]
    if missing:
        raise PreflightError(
            f"not installed: {', '.join(missing)}; run `uv sync` (./scripts/up does it)"
        )


def port_free(port: int) -> bool:
    """Whether a server could listen on ``127.0.0.1:port`` now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _any_free_port(avoid: set[int]) -> int:
    while True:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        if port not in avoid:
            return port


def settle_ports(config: StackConfig) -> tuple[StackConfig, list[str]]:
    """``config`` with each port it was not given (:attr:`StackConfig.pick_free`)
    that another process holds (another checkout's stack, its Prometheus) moved to
    a free one, and a line per move. Ports given explicitly stay as given:
    :func:`check_ports` refuses them when taken."""
    taken: set[int] = set()
    moved: list[str] = []

    def settle(group: str, names: tuple[str, ...], ports: tuple[int, ...]) -> tuple[int, ...]:
        chosen = []
        for name, port in zip(names, ports, strict=True):
            if group in config.pick_free and port != 0 and (port in taken or not port_free(port)):
                new = _any_free_port(taken | set(ports))
                moved.append(f"{name} port {port} is taken: using {new}")
                port = new
            taken.add(port)
            chosen.append(port)
        return tuple(chosen)

    services = ("admission", "substrate", "affinity")
    a, s, f = settle("grpc", services, config.ports)
    ma, ms, mf = settle("metrics", tuple(f"{n} metrics" for n in services), config.metrics_ports)
    (prometheus,) = settle("prometheus", ("Prometheus",), (config.prometheus_port,))
    settled = replace(
        config, ports=(a, s, f), metrics_ports=(ma, ms, mf), prometheus_port=prometheus
    )
    return settled, moved


def check_ports(config: StackConfig) -> None:
    for port in (*config.ports, *config.metrics_ports):
        if port != 0 and not port_free(port):
            raise PreflightError(
                f"port {port} is in use: is a stack already running? (turnstilectl status)"
            )


async def check_redis(url: str) -> None:
    client = create_redis(url, timeout_s=2.0)  # any topology the services accept
    try:
        await client.ping()
    except Exception as error:
        raise PreflightError(
            f"Redis does not answer at {redacted(url)} ({error}); ./scripts/up starts one"
        ) from None
    finally:
        await client.aclose()


async def ensure_database(url: str) -> bool:
    """Create the database of ``url`` when missing; True if it was created."""
    parts = urlsplit(url)
    name = parts.path.lstrip("/") or "postgres"
    try:
        admin = await asyncpg.connect(urlunsplit(parts._replace(path="/postgres")), timeout=5)
    except Exception as error:
        raise PreflightError(
            f"PostgreSQL does not answer at {redacted(url)} ({error}); ./scripts/up starts one"
        ) from None
    try:
        if await admin.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name):
            return False
        quoted = '"' + name.replace('"', '""') + '"'
        try:
            await admin.execute(f"CREATE DATABASE {quoted}")
        except asyncpg.DuplicateDatabaseError:
            return False
        return True
    finally:
        await admin.close()


async def migrate(config: StackConfig, printer: LogPrinter) -> None:
    """Run ``turnstile-migrate`` (idempotent) against the stack's database."""
    command = find_command("turnstile-migrate")
    assert command is not None
    env = {**config.common_env(), "TURNSTILE_DATABASE_URL": config.database_url}
    import os

    proc = await asyncio.create_subprocess_exec(
        command,
        env={**os.environ, **env},
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    assert proc.stdout is not None
    await printer.pump("migrate", proc.stdout)
    if await proc.wait() != 0:
        raise PreflightError(f"turnstile-migrate failed (exit {proc.returncode})")
