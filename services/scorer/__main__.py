"""`python -m services.scorer`: run one scorer process."""

from services.scorer.app import create_app
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from shared.runtime import run_service

if __name__ == "__main__":
    settings = ScorerSettings()
    run_service("scorer", settings, lambda: create_app(settings, ModelSettings()))
