"""Turnstile's protobuf contracts, the one door to the generated code.

Every service and library imports messages and stubs from here, never from the
generated ``turnstile.*`` packages (an import-linter contract enforces it), so the
generated layout can change without touching callers.
"""

from turnstile.admission.v1 import admission_pb2, admission_pb2_grpc
from turnstile.affinity.v1 import affinity_pb2, affinity_pb2_grpc
from turnstile.common.v1 import common_pb2
from turnstile.substrate.v1 import substrate_pb2, substrate_pb2_grpc

#: The ``google.rpc.ErrorInfo.domain`` of every Turnstile error.
ERROR_DOMAIN = "turnstile.dev"

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
