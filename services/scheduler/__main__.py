"""`python -m services.scheduler`: run the scheduler."""

from services.scheduler.app import create_app
from services.scheduler.settings import SchedulerSettings
from shared.runtime import run_service

if __name__ == "__main__":
    settings = SchedulerSettings()
    run_service("scheduler", settings, lambda: create_app(settings))
