"""Which Redis deployment a URL names: a single server, a Sentinel-managed primary, a Cluster.

SPEC F2: Turnstile runs on Redis as users run it. One setting,
``TURNSTILE_REDIS_URL``, names all three, told apart by the scheme:

- ``redis://h:6379/0``, ``rediss://…``, ``unix:///path?db=0`` — one server;
- ``redis+sentinel://[user:pass@]s1:26379,s2:26379/<service>[/<db>]`` — the
  primary that the sentinels at ``s1``, ``s2`` … name for ``<service>``
  (``rediss+sentinel://`` for TLS to the Redis servers and the sentinels);
- ``redis+cluster://[user:pass@]n1:6379,n2:6379`` — a Redis Cluster, any of its
  nodes as seeds (``rediss+cluster://`` for TLS); Cluster has database 0 only.

The user and password in the URL are the Redis servers' (a password belongs in
``TURNSTILE_REDIS_PASSWORD_FILE``); sentinels that require a password of their
own take it from ``TURNSTILE_REDIS_SENTINEL_PASSWORD_FILE``. Messages never
echo the URL: it may carry a password (SPEC Z4).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from urllib.parse import unquote

from pydantic_core import MultiHostUrl

#: Every scheme ``TURNSTILE_REDIS_URL`` accepts.
SCHEMES = (
    "redis",
    "rediss",
    "unix",
    "redis+sentinel",
    "rediss+sentinel",
    "redis+cluster",
    "rediss+cluster",
)


class Topology(enum.Enum):
    SINGLE = "single"
    SENTINEL = "sentinel"
    CLUSTER = "cluster"


@dataclass(frozen=True)
class RedisTarget:
    """A parsed Redis URL: what to connect to and as whom."""

    topology: Topology
    #: ``(host, port)`` of each sentinel or cluster seed; empty for a single server.
    nodes: tuple[tuple[str, int], ...]
    tls: bool
    #: The Sentinel service (master) name; empty otherwise.
    service: str = ""
    db: int = 0
    username: str | None = None
    password: str | None = None


_DEFAULT_PORTS = {Topology.SENTINEL: 26379, Topology.CLUSTER: 6379}


def parse_redis_url(url: str) -> RedisTarget:
    """The deployment ``url`` names; ``ValueError`` (never quoting ``url``) when invalid."""
    try:
        parsed = MultiHostUrl(url)
    except ValueError:
        raise ValueError("not a valid URL") from None
    scheme = parsed.scheme
    if scheme not in SCHEMES:
        raise ValueError(f"scheme must be one of {', '.join(SCHEMES)}")
    base, _, kind = scheme.partition("+")
    if not kind:
        return RedisTarget(Topology.SINGLE, (), tls=scheme == "rediss")
    topology = Topology(kind)
    hosts = parsed.hosts()
    nodes = tuple(
        (host["host"], host["port"] or _DEFAULT_PORTS[topology]) for host in hosts if host["host"]
    )
    if not nodes:
        raise ValueError(f"a {kind} URL needs at least one host:port")
    username = hosts[0]["username"]
    password = hosts[0]["password"]
    parts = [unquote(part) for part in (parsed.path or "").split("/") if part]
    service, db = "", 0
    if topology is Topology.SENTINEL:
        if not parts or len(parts) > 2:
            raise ValueError("a sentinel URL's path is /<service> or /<service>/<db>")
        service = parts[0]
        db = _db(parts[1]) if len(parts) == 2 else 0
    elif parts and parts != ["0"]:
        raise ValueError("a cluster URL has no path (Redis Cluster has database 0 only)")
    if parsed.query:
        raise ValueError(f"a {kind} URL takes no query parameters")
    return RedisTarget(
        topology,
        nodes,
        tls=base == "rediss",
        service=service,
        db=db,
        username=unquote(username) if username else None,
        password=unquote(password) if password else None,
    )


def _db(text: str) -> int:
    if not text.isdigit():
        raise ValueError("the database in a sentinel URL is a number")
    return int(text)
