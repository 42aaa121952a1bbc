"""Which priority level and flow a call is counted in (SPEC N1), from what the
authorizer already knows: the caller's identity and its policy decision.

The level follows the identity's role in the policy: an identity allowed every
client for the method (``clients = "any"``: the services, operators) is the
platform's; one scoped to its own clients (``self`` or a list) is a tenant's.
``roles`` (``TURNSTILE_FAIR_SHARE__ROLES``) places identities whose grant does not
say their role (the gateway's placements, the sandboxes' relay streams) by their
SPIFFE ID path. Loopback plaintext has no identity: one anonymous flow of the
platform level.

The flow is the identity and, for a method that acts for a client
(:data:`~turnstile_platform.authz.methods.CLIENT_SOURCES`), the client the request
names — read from the request already decoded, never looked up: a sandbox-addressed
call counts for the client of the id's namespace. A client the decision does not
let the caller act for is left out (the call is refused next; it gets no flow of
its own to hide in).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from turnstile_platform.authz.methods import (
    INHERIT,
    ClientSource,
    FromActivationClient,
    FromRequest,
    PlatformWide,
    activation_client,
)
from turnstile_platform.authz.ownership import ECHO_CHARS, namespace_of
from turnstile_platform.authz.policy import AuthzDecision
from turnstile_platform.fair_share import FlowId, Level

#: The one flow of a server without authorization (loopback plaintext).
ANONYMOUS = FlowId(Level.PLATFORM, "", "", "anonymous")

_CACHE_LIMIT = 8192


class FlowClassifier:
    """Maps (identity, decision, request) to its :class:`FlowId`, cached per
    identity, client and grant."""

    def __init__(self, roles: Mapping[str, str]) -> None:
        self._exact = {
            path: Level(level) for path, level in roles.items() if not path.endswith("/*")
        }
        # Longest prefix first: the most specific pattern wins.
        self._prefixes = sorted(
            ((path[:-1], Level(level)) for path, level in roles.items() if path.endswith("/*")),
            key=lambda item: -len(item[0]),
        )
        self._flows: dict[tuple[str, str, bool, str], FlowId] = {}

    def level(self, identity: str, any_client: bool) -> Level:
        """The level of ``identity``'s calls, given whether it may act for any client."""
        path = _path(identity)
        found = self._exact.get(path)
        if found is not None:
            return found
        for prefix, level in self._prefixes:
            if path.startswith(prefix):
                return level
        return Level.PLATFORM if any_client else Level.TENANTS

    def flow(
        self, identity: str, decision: AuthzDecision, source: ClientSource | None, request: Any
    ) -> FlowId:
        """The flow of a call by ``identity`` allowed by ``decision``."""
        try:
            client = client_hint(source, request) if source is not None else None
        except AttributeError:  # a handler of the path that takes other messages
            client = None
        if client is None or not decision.allows_client(client):
            client = ""
        client = client[:ECHO_CHARS]
        key = (identity, client, decision.any_client, decision.label)
        found = self._flows.get(key)
        if found is None:
            if len(self._flows) >= _CACHE_LIMIT:
                self._flows.clear()
            found = self._flows[key] = FlowId(
                self.level(identity, decision.any_client), identity, client, decision.label
            )
        return found


def client_hint(source: ClientSource, request: Any) -> str | None:
    """The client a request names for ``source``, without a lookup (a sandbox id
    stands for its namespace's client; None: none named)."""
    if isinstance(source, FromRequest):
        return source.client(request)
    if isinstance(source, FromActivationClient):
        named = activation_client(source.client(request))
        if named is not INHERIT:
            return named if isinstance(named, str) else None
        return namespace_of(source.sandbox_id(request)) if source.sandbox_id is not None else None
    if isinstance(source, PlatformWide):
        return None  # acts for no one client: the caller's identity alone is its flow
    return namespace_of(source.sandbox_id(request))


def _path(identity: str) -> str:
    """The path of a SPIFFE ID (``spiffe://td/a/b`` → ``/a/b``)."""
    _, _, rest = identity.partition("://")
    _, slash, path = rest.partition("/")
    return slash + path
