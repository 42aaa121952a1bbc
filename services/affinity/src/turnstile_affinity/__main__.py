"""``turnstile-affinity``: run the affinity service until SIGTERM/SIGINT."""

from __future__ import annotations

from turnstile_affinity.app import SERVICE_NAME, create_app
from turnstile_affinity.settings import AffinitySettings
from turnstile_platform.runner import run_service
from turnstile_platform.settings import ServiceSettings


async def _serve(settings: ServiceSettings) -> None:
    assert isinstance(settings, AffinitySettings)
    app = await create_app(settings)
    await app.serve()


def main() -> None:
    run_service(SERVICE_NAME, AffinitySettings(), _serve)


if __name__ == "__main__":
    main()
