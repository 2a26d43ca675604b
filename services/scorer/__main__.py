"""`python -m services.scorer`: run one scorer process."""

from services.scorer.app import create_app
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from shared.runtime import run_service
from shared.settings import settings_or_exit

if __name__ == "__main__":
    settings = settings_or_exit(ScorerSettings, "scorer")
    model = settings_or_exit(ModelSettings, "scorer")
    run_service("scorer", settings, lambda: create_app(settings, model))
