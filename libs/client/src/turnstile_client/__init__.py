"""Turnstile's Python client: typed async calls with mTLS, deadlines, RetryInfo-driven
retries and one shape for refusals (docs/clients.md)."""

from turnstile_client.client import DEFAULT_TRUST_DOMAIN, Retry, Tls, TurnstileClient, server_name
from turnstile_client.errors import Refused, TurnstileError, decode, refused_admit
from turnstile_contracts.rich_status import Violation

__all__ = [
    "DEFAULT_TRUST_DOMAIN",
    "Refused",
    "Retry",
    "Tls",
    "TurnstileClient",
    "TurnstileError",
    "Violation",
    "decode",
    "refused_admit",
    "server_name",
]
