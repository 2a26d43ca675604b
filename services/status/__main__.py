"""`python -m services.status`: run the status service."""

from services.status.app import create_app
from services.status.settings import StatusSettings
from shared.runtime import run_service
from shared.settings import settings_or_exit

if __name__ == "__main__":
    settings = settings_or_exit(StatusSettings, "status")
    run_service("status", settings, lambda: create_app(settings))
