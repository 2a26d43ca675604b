"""Settings of the status service (environment variables in README)."""

from __future__ import annotations

from pydantic import Field

from shared.settings import (
    MAX_DURATION_S,
    MAX_PREFETCH,
    READ_YOUR_WRITES_MAX_S,
    InternalApiSettings,
)


class StatusSettings(InternalApiSettings):
    port: int = Field(default=8001, validation_alias="STATUS_PORT")
    # How long a finished task stays readable (the seed's `expirationTtl: 3600`).
    finished_task_ttl_s: int = Field(
        default=3600,
        ge=READ_YOUR_WRITES_MAX_S,
        le=MAX_DURATION_S,
        validation_alias="FINISHED_TASK_TTL_S",
    )
    projection_prefetch: int = Field(
        default=256, gt=0, le=MAX_PREFETCH, validation_alias="PROJECTION_PREFETCH"
    )
    # State changes kept per task for SSE replay (attempts x 2 + a few suffice).
    history_limit: int = Field(default=64, ge=4, le=1000, validation_alias="TASK_HISTORY_LIMIT")
