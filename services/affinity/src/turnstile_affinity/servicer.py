"""The AffinityService gRPC handlers: thin, validate → domain → contract."""

from __future__ import annotations

from turnstile_contracts import affinity_pb2_grpc


class AffinityServicer(affinity_pb2_grpc.AffinityServiceServicer):
    """RPCs arrive here; unimplemented ones answer UNIMPLEMENTED."""
