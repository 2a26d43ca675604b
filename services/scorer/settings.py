"""Settings of the scorer (environment variables in README); model settings live in
`services.scorer.model.settings`."""

from __future__ import annotations

from pydantic import Field

from shared.settings import ServiceSettings


class ScorerSettings(ServiceSettings):
    port: int = Field(default=8002, validation_alias="SCORER_PORT")
    # Messages in flight per scorer process = model calls in flight (the seed's pool, §5.2).
    concurrency: int = Field(default=16, ge=1, le=4096, validation_alias="SCORER_CONCURRENCY")
    retry_base_s: float = Field(default=2.0, gt=0, validation_alias="RETRY_BASE_S")
    retry_cap_s: float = Field(default=300.0, gt=0, validation_alias="RETRY_CAP_S")
    # Redeliveries of a message whose handling crashed before it goes to the DLQ.
    crash_limit: int = Field(default=3, ge=1, validation_alias="SCORER_CRASH_LIMIT")
    # `task.started` is published for an attempt still running after this long (0 = at once):
    # an attempt that ends sooner goes straight to its outcome, one message fewer per task.
    started_after_s: float = Field(default=1.0, ge=0, validation_alias="SCORER_STARTED_AFTER_S")
    # A claim outlives the model call by this margin before another worker may take it over.
    lease_margin_s: float = Field(default=30.0, gt=0, validation_alias="LEASE_MARGIN_S")
    # How long a task's claim (with its decision and the raw model output) is kept.
    attempts_retention_s: int = Field(
        default=7 * 86_400, gt=0, validation_alias="ATTEMPTS_RETENTION_S"
    )
