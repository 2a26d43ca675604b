"""`python -m services.notifier`: run the notifier."""

from services.notifier.app import create_app
from services.notifier.settings import NotifierSettings
from shared.runtime import run_service

if __name__ == "__main__":
    settings = NotifierSettings()
    run_service("notifier", settings, lambda: create_app(settings))
