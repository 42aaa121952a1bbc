"""``turnstile-admission``: run the admission service until SIGTERM/SIGINT."""

from __future__ import annotations

from turnstile_admission.app import SERVICE_NAME, create_app
from turnstile_admission.settings import AdmissionSettings
from turnstile_platform.runner import run_service
from turnstile_platform.settings import ServiceSettings


async def _serve(settings: ServiceSettings) -> None:
    assert isinstance(settings, AdmissionSettings)
    app = await create_app(settings)
    await app.serve()


def main() -> None:
    run_service(SERVICE_NAME, AdmissionSettings(), _serve)


if __name__ == "__main__":
    main()
