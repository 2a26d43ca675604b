"""`python -m services.status`: run the status service."""

from services.status.app import create_app
from services.status.settings import StatusSettings
from shared.runtime import configure_logging, run, serve


async def main() -> None:
    settings = StatusSettings()
    configure_logging(settings, "status")
    await serve(
        create_app(settings),
        host=settings.http_host,
        port=settings.port,
        log_level=settings.log_level,
    )


if __name__ == "__main__":
    run(main)
