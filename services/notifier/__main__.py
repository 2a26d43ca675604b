"""`python -m services.notifier`: run the notifier."""

from services.notifier.app import create_app
from services.notifier.settings import NotifierSettings
from shared.runtime import configure_logging, run, serve


async def main() -> None:
    settings = NotifierSettings()
    configure_logging(settings, "notifier")
    await serve(
        create_app(settings),
        host=settings.http_host,
        port=settings.port,
        log_level=settings.log_level,
    )


if __name__ == "__main__":
    run(main)
