"""Wiring of the affinity process: settings → resources → servicer → server."""

from __future__ import annotations

from turnstile_affinity.servicer import AffinityServicer
from turnstile_affinity.settings import AffinitySettings
from turnstile_contracts import affinity_pb2_grpc
from turnstile_platform import peers
from turnstile_platform.metrics import MetricsEndpoint
from turnstile_platform.server import GrpcService

SERVICE_NAME = "turnstile-affinity"


async def create_app(settings: AffinitySettings) -> GrpcService:
    """A ready-to-start server for the affinity service."""
    app = GrpcService(SERVICE_NAME, settings, service_names=[peers.AFFINITY])
    affinity_pb2_grpc.add_AffinityServiceServicer_to_server(AffinityServicer(), app.server)  # type: ignore[abstract]  # RPCs land with their issue
    metrics = MetricsEndpoint(settings.host, settings.metrics_port)
    app.add_cleanup(metrics.close)
    return app
