"""The AdmissionService gRPC handlers: thin, validate → domain → contract."""

from __future__ import annotations

from turnstile_contracts import admission_pb2_grpc


class AdmissionServicer(admission_pb2_grpc.AdmissionServiceServicer):
    """RPCs arrive here; unimplemented ones answer UNIMPLEMENTED."""
