"""Wiring of the admission process: settings → resources → servicer → server."""

from __future__ import annotations

from turnstile_admission.servicer import AdmissionServicer
from turnstile_admission.settings import AdmissionSettings
from turnstile_contracts import admission_pb2_grpc
from turnstile_platform import peers
from turnstile_platform.metrics import MetricsEndpoint
from turnstile_platform.server import GrpcService

SERVICE_NAME = "turnstile-admission"


async def create_app(settings: AdmissionSettings) -> GrpcService:
    """A ready-to-start server for the admission service."""
    app = GrpcService(SERVICE_NAME, settings, service_names=[peers.ADMISSION])
    admission_pb2_grpc.add_AdmissionServiceServicer_to_server(AdmissionServicer(), app.server)  # type: ignore[abstract]  # RPCs land with their issue
    metrics = MetricsEndpoint(settings.host, settings.metrics_port)
    app.add_cleanup(metrics.close)
    return app
