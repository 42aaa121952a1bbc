"""Presence labels the relay reads besides the tier (``turnstile.dev/tier``, SPEC T1)."""

#: The address a worker serves on; Place returns it as ``endpoint``.
ENDPOINT_LABEL = "endpoint"

#: The sandbox's owner in a presence's labels: what the credential attests (SPEC O3),
#: or, with attestation off only, what the Hello says (the pod label's key).
OWNER_LABEL = "turnstile.dev/client-id"
