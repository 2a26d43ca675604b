"""`python -m services.gateway`: run the public API."""

from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings
from shared.runtime import configure_logging, run, serve


async def main() -> None:
    settings = GatewaySettings()
    configure_logging(settings, "gateway")
    await serve(
        create_app(settings),
        host=settings.http_host,
        port=settings.port,
        log_level=settings.log_level,
    )


if __name__ == "__main__":
    run(main)
