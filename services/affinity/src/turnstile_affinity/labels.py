"""Presence labels the relay reads besides the tier (``turnstile.dev/tier``, SPEC T1)."""

#: The address a worker serves on; Place returns it as ``endpoint``.
ENDPOINT_LABEL = "endpoint"
