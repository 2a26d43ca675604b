"""`python -m services.status`: run the status service."""

from services.status.app import create_app
from services.status.settings import StatusSettings
from shared.runtime import run_service

if __name__ == "__main__":
    settings = StatusSettings()
    run_service("status", settings, lambda: create_app(settings))
