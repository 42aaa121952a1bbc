"""The Direct substrate: sandbox runtimes as processes on this host (SPEC S1, S4, S7).

Kept free of imports so ``python -m turnstile_substrate.direct.idle_runtime``
starts fast; the substrate itself is :mod:`turnstile_substrate.direct.substrate`.
"""
