"""The SubstrateService gRPC handlers: thin, validate → domain → contract."""

from __future__ import annotations

from turnstile_contracts import substrate_pb2_grpc


class SubstrateServicer(substrate_pb2_grpc.SubstrateServiceServicer):
    """RPCs arrive here; unimplemented ones answer UNIMPLEMENTED."""
