"""`python -m services.notifier`: run the notifier."""

from services.notifier.app import create_app
from services.notifier.settings import NotifierSettings
from shared.runtime import run_service
from shared.settings import settings_or_exit

if __name__ == "__main__":
    settings = settings_or_exit(NotifierSettings, "notifier")
    run_service("notifier", settings, lambda: create_app(settings))
