"""Settings of the scorer (environment variables in README); model settings live in
`services.scorer.model.settings`."""

from __future__ import annotations

from typing import Self

from pydantic import Field, model_validator

from shared.settings import MAX_DURATION_S, MAX_PREFETCH, MetricsApiSettings

MAX_LEASE_MARGIN_S = 120.0
MIN_ATTEMPTS_RETENTION_S = 2 * 86_400


class ScorerSettings(MetricsApiSettings):
    port: int = Field(default=8002, validation_alias="SCORER_PORT")
    # Model calls in flight per scorer process (the seed's pool, §5.2).
    concurrency: int = Field(default=16, ge=1, le=4096, validation_alias="SCORER_CONCURRENCY")
    # Deliveries in hand per scorer process (the prefetch): those beyond `concurrency` wait
    # for a model slot (services/scorer/slots.py). Unset: twice `concurrency`.
    prefetch: int | None = Field(
        default=None, ge=1, le=MAX_PREFETCH, validation_alias="SCORER_PREFETCH"
    )
    retry_base_s: float = Field(
        default=2.0, gt=0, le=MAX_DURATION_S, validation_alias="RETRY_BASE_S"
    )
    retry_cap_s: float = Field(
        default=300.0, gt=0, le=MAX_DURATION_S, validation_alias="RETRY_CAP_S"
    )
    # Attempts the provider's rate limit (429), or an outage's pause (its probes), may end
    # without counting against a task's SCORE_MAX_ATTEMPTS (services/scorer/throttle.py).
    rate_limit_retries: int = Field(
        default=20, ge=0, le=1000, validation_alias="RATE_LIMIT_RETRIES"
    )
    # The longest a delivery waits in hand for rate-limit pauses to end, in all; a longer
    # wait sends it down the wait ladder. Well under RabbitMQ's consumer timeout (30 min).
    rate_limit_hold_s: float = Field(
        default=30.0, gt=0, le=600, validation_alias="RATE_LIMIT_HOLD_S"
    )
    # Redeliveries of a message whose handling crashed before it goes to the DLQ.
    crash_limit: int = Field(default=3, ge=1, validation_alias="SCORER_CRASH_LIMIT")
    # `task.started` is published for an attempt still running after this long (0 = at once):
    # an attempt that ends sooner goes straight to its outcome, one message fewer per task.
    started_after_s: float = Field(
        default=1.0, ge=0, le=MAX_DURATION_S, validation_alias="SCORER_STARTED_AFTER_S"
    )
    # Completions without a callback that arrive while an outcome's publish awaits its
    # confirm go out together, up to this many in one message (shared/batched_publish.py);
    # 1 sends each alone, for consumers of a build that predates batches. At most 256: a
    # batch's header (about 150 bytes per event) must fit one AMQP frame (128 KiB).
    outcome_batch_max: int = Field(
        default=16, ge=1, le=256, validation_alias="SCORER_OUTCOME_BATCH_MAX"
    )
    # A claim outlives the model call by this margin before another worker may take it over.
    # At most 120 s: a held redelivery waits out a whole claim inside the broker's consumer
    # timeout (see MAX_LLM_TIMEOUT_S).
    lease_margin_s: float = Field(
        default=30.0, gt=0, le=MAX_LEASE_MARGIN_S, validation_alias="LEASE_MARGIN_S"
    )
    # How long a task's claim (with its decision and the raw model output) is kept; at least
    # two days. A retry the provider asked to wait for may be due a day later
    # (`scoring.MAX_RETRY_AFTER_S`), and a late copy of a command (the outbox's, a DLQ's) may
    # come as long after: a record expired before them is claimed anew, and the model called
    # again, also for a task cancelled meanwhile (found in review, with an hour).
    attempts_retention_s: int = Field(
        default=7 * 86_400,
        ge=MIN_ATTEMPTS_RETENTION_S,
        le=MAX_DURATION_S,
        validation_alias="ATTEMPTS_RETENTION_S",
    )

    @model_validator(mode="after")
    def _prefetch_covers_the_model_slots(self) -> Self:
        if self.prefetch is not None and self.prefetch < self.concurrency:
            raise ValueError(
                f"SCORER_PREFETCH ({self.prefetch}) must be at least SCORER_CONCURRENCY "
                f"({self.concurrency}): fewer deliveries in hand would leave model slots idle"
            )
        return self

    @property
    def deliveries_in_hand(self) -> int:
        return self.prefetch or 2 * self.concurrency
