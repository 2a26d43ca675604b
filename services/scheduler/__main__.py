"""`python -m services.scheduler`: run the scheduler."""

from services.scheduler.app import create_app
from services.scheduler.settings import SchedulerSettings
from shared.runtime import configure_logging, run, serve


async def main() -> None:
    settings = SchedulerSettings()
    configure_logging(settings, "scheduler")
    await serve(
        create_app(settings),
        host=settings.http_host,
        port=settings.port,
        log_level=settings.log_level,
    )


if __name__ == "__main__":
    run(main)
