"""`python -m services.scheduler`: run the scheduler."""

from services.scheduler.app import create_app
from services.scheduler.settings import SchedulerSettings
from shared.runtime import run_service
from shared.settings import settings_or_exit

if __name__ == "__main__":
    settings = settings_or_exit(SchedulerSettings, "scheduler")
    run_service("scheduler", settings, lambda: create_app(settings))
