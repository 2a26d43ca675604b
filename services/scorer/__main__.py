"""`python -m services.scorer`: run one scorer process."""

from services.scorer.app import create_app
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from shared.runtime import configure_logging, run, serve


async def main() -> None:
    settings = ScorerSettings()
    configure_logging(settings, "scorer")
    await serve(
        create_app(settings, ModelSettings()),
        host=settings.http_host,
        port=settings.port,
        log_level=settings.log_level,
    )


if __name__ == "__main__":
    run(main)
