"""The worker agent: a sandbox runtime's presence at the affinity relay (SPEC T1).

Run as ``turnstile-worker`` (or ``python -m turnstile_affinity.worker``); the
Direct substrate runs it as a sandbox's runtime process.
"""
