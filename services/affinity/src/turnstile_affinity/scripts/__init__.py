"""Lua scripts of the affinity store (see ``turnstile_affinity.store``)."""
