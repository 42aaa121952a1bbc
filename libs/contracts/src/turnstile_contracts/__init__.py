"""Turnstile's protobuf contracts, the one door to the generated code.

Every service and library imports messages and stubs from here, never from the
generated ``turnstile.*`` packages (an import-linter contract enforces it), so the
generated layout can change without touching callers.

The modules are imported on first use (PEP 562 ``__getattr__``): a process pays
for the contracts it touches, not for all of them (``turnstilectl status`` uses
none, ``turnstilectl usage`` only admission's).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from turnstile.admission.v1 import admission_pb2, admission_pb2_grpc
    from turnstile.affinity.v1 import affinity_pb2, affinity_pb2_grpc
    from turnstile.common.v1 import common_pb2
    from turnstile.substrate.v1 import substrate_pb2, substrate_pb2_grpc

#: The ``google.rpc.ErrorInfo.domain`` of every Turnstile error.
ERROR_DOMAIN = "turnstile.dev"

_MODULES = {
    "admission_pb2": "turnstile.admission.v1.admission_pb2",
    "admission_pb2_grpc": "turnstile.admission.v1.admission_pb2_grpc",
    "affinity_pb2": "turnstile.affinity.v1.affinity_pb2",
    "affinity_pb2_grpc": "turnstile.affinity.v1.affinity_pb2_grpc",
    "common_pb2": "turnstile.common.v1.common_pb2",
    "substrate_pb2": "turnstile.substrate.v1.substrate_pb2",
    "substrate_pb2_grpc": "turnstile.substrate.v1.substrate_pb2_grpc",
}


def __getattr__(name: str) -> object:
    path = _MODULES.get(name)
    if path is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    module = importlib.import_module(path)
    globals()[name] = module
    return module


__all__ = [
    "ERROR_DOMAIN",
    "admission_pb2",
    "admission_pb2_grpc",
    "affinity_pb2",
    "affinity_pb2_grpc",
    "common_pb2",
    "substrate_pb2",
    "substrate_pb2_grpc",
]
