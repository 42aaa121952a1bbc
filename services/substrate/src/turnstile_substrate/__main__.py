"""``turnstile-substrate``: run the substrate service until SIGTERM/SIGINT."""

from __future__ import annotations

from turnstile_platform.runner import run_service
from turnstile_platform.settings import ServiceSettings
from turnstile_substrate.app import SERVICE_NAME, create_app
from turnstile_substrate.settings import SubstrateSettings


async def _serve(settings: ServiceSettings) -> None:
    assert isinstance(settings, SubstrateSettings)
    app = await create_app(settings)
    await app.serve()


def main() -> None:
    run_service(SERVICE_NAME, SubstrateSettings(), _serve)


if __name__ == "__main__":
    main()
