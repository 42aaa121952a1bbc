"""Wiring of the substrate process: settings → resources → servicer → server."""

from __future__ import annotations

from turnstile_contracts import substrate_pb2_grpc
from turnstile_platform import peers
from turnstile_platform.metrics import MetricsEndpoint
from turnstile_platform.server import GrpcService
from turnstile_substrate.servicer import SubstrateServicer
from turnstile_substrate.settings import SubstrateSettings

SERVICE_NAME = "turnstile-substrate"


async def create_app(settings: SubstrateSettings) -> GrpcService:
    """A ready-to-start server for the substrate service."""
    app = GrpcService(SERVICE_NAME, settings, service_names=[peers.SUBSTRATE])
    substrate_pb2_grpc.add_SubstrateServiceServicer_to_server(SubstrateServicer(), app.server)  # type: ignore[abstract]  # RPCs land with their issue
    metrics = MetricsEndpoint(settings.host, settings.metrics_port)
    app.add_cleanup(metrics.close)
    return app
