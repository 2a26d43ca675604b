"""Settings of the scheduler (environment variables in README)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import ServiceSettings


class SchedulerSettings(ServiceSettings):
    port: int = Field(default=8003, validation_alias="SCHEDULER_PORT")
