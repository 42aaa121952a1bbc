"""The affinity service: keep a chat session on the sandbox that served it, inside
its tier (SPEC T1–T9)."""
