"""Settings of the scheduler (environment variables in README).

The jobs themselves (cron expressions, zones, prices) live in the TOML file named by
`SCHEDULER_CONFIG`; see `services.scheduler.config`.
"""

from __future__ import annotations

from pathlib import Path
from typing import Self

from pydantic import Field, field_validator, model_validator

from services.scheduler.config import DEFAULT_CONFIG_PATH
from shared.contracts import known_rubric_version
from shared.settings import (
    BROKER_CONSUMER_TIMEOUT_S,
    MAX_DURATION_S,
    MAX_PREFETCH,
    AdminApiSettings,
)
from shared.topology import SCORE_QUEUE_MAX_LENGTH

MAX_JOB_ATTEMPTS = 20
# Pages of the re-score fan-out one delivery reads at most: with pages of 10,000, already far
# past what `SCHEDULER_JOB_DB_TIMEOUT_S` lets one delivery do.
MAX_FANOUT_PAGES = 1_000
# Ticks a firing may lose between its fire time and being seen stale, whose publish failed:
# claimed up to a tick late, seen stale up to a tick late, and their work.
REDISPATCH_TICKS = 3


class SchedulerSettings(AdminApiSettings):
    port: int = Field(default=8003, validation_alias="SCHEDULER_PORT")
    config_path: Path = Field(default=DEFAULT_CONFIG_PATH, validation_alias="SCHEDULER_CONFIG")
    # How often the dispatcher looks for due firings.
    tick_s: float = Field(default=1.0, gt=0, le=MAX_DURATION_S, validation_alias="SCHEDULER_TICK_S")
    # A fire time older than this when first seen counts as missed (policy `skip` drops it).
    grace_s: float = Field(
        default=60.0, ge=0, le=MAX_DURATION_S, validation_alias="SCHEDULER_GRACE_S"
    )
    # A firing claimed but not yet published after this long is published again (the claiming
    # replica died or the broker refused the publish).
    redispatch_after_s: float = Field(
        default=30.0, gt=0, le=MAX_DURATION_S, validation_alias="SCHEDULER_REDISPATCH_S"
    )
    # Attempts of one run (one slice of it) before it is dead-lettered. At most 20, as the
    # gateway's SCORE_MAX_ATTEMPTS: past the back-off's cap each more attempt only waits it
    # again (and unbounded, the back-off's doubling overflowed before the cap was applied).
    job_max_attempts: int = Field(
        default=4, ge=1, le=MAX_JOB_ATTEMPTS, validation_alias="SCHEDULER_JOB_MAX_ATTEMPTS"
    )
    job_retry_base_s: float = Field(
        default=5.0, gt=0, le=MAX_DURATION_S, validation_alias="SCHEDULER_RETRY_BASE_S"
    )
    job_retry_cap_s: float = Field(
        default=600.0, gt=0, le=MAX_DURATION_S, validation_alias="SCHEDULER_RETRY_CAP_S"
    )
    # A run of a job that forbids overlapping runs that shows no sign of life for this long
    # (no delivery started, no retry recorded: its message lost, say) is recorded failed,
    # "abandoned", and no longer keeps its job's next firings from running. Above the
    # broker's consumer timeout plus SCHEDULER_RETRY_CAP_S, the longest a live run goes
    # without one.
    run_stale_s: float = Field(
        default=3600.0, gt=0, le=MAX_DURATION_S, validation_alias="SCHEDULER_RUN_STALE_S"
    )
    # The deadline of all the database work of one delivery of a job run (`pymongo.timeout`
    # around its handler), in place of MONGO_TIMEOUT_S, which is meant for request handling:
    # a rollup's `update_many` over a day of usage records outlasts that, and every retry
    # failed the same way. Below the broker's consumer timeout, which the delivery is held in.
    job_db_timeout_s: float = Field(
        default=300.0,
        gt=0,
        lt=BROKER_CONSUMER_TIMEOUT_S,
        validation_alias="SCHEDULER_JOB_DB_TIMEOUT_S",
    )
    # Job runs in flight per scheduler process (prefetch of the cron-jobs consumer).
    job_concurrency: int = Field(
        default=4, ge=1, le=MAX_PREFETCH, validation_alias="SCHEDULER_JOB_CONCURRENCY"
    )
    # Usage records one slice of the usage rollup reads, counts and marks: a slice that finds
    # a full batch pending continues the run in a new one. Every slice recomputes the days it
    # touches in full, so a day of n records costs about n² / batch record reads over its
    # slices (services/scheduler/jobs/usage.py).
    # At most 100,000: the slice's `_id`s travel in one command (`$in`).
    usage_rollup_batch: int = Field(
        default=20_000, ge=1, le=100_000, validation_alias="USAGE_ROLLUP_BATCH"
    )
    meter_prefetch: int = Field(
        default=256, ge=1, le=MAX_PREFETCH, validation_alias="USAGE_METER_PREFETCH"
    )
    # Attempts to store one usage event before it is dead-lettered, when storing fails other
    # than by MongoDB being unavailable (which is waited out, the delivery held).
    meter_max_attempts: int = Field(
        default=5, ge=1, le=MAX_JOB_ATTEMPTS, validation_alias="USAGE_METER_MAX_ATTEMPTS"
    )
    meter_retry_s: float = Field(
        default=5.0, gt=0, le=MAX_DURATION_S, validation_alias="USAGE_METER_RETRY_S"
    )
    # The current rubric/prompt version; tasks scored with another (or an unknown) version are
    # re-scored by the fan-out. Unset: the fan-out refuses to run.
    rubric_version: str | None = Field(default=None, validation_alias="RUBRIC_VERSION")

    @model_validator(mode="after")
    def _grace_outlasts_the_clock_loop(self) -> Self:
        # A fire time is first seen up to a tick (plus the tick's own work) after it: with a
        # shorter grace a job's first firing and every `skip` job's firing count as missed.
        if self.grace_s < 2 * self.tick_s:
            raise ValueError(
                f"SCHEDULER_GRACE_S ({self.grace_s}) must be at least twice SCHEDULER_TICK_S "
                f"({self.tick_s}): fire times would be late by the time a tick sees them"
            )
        # A never-published firing is published again only while it is within the grace;
        # later, a `skip` job's firing is dropped, so it would never run. It is claimed up
        # to a tick after its fire time and seen stale up to a tick after it became so,
        # each tick's work besides: 59.5 s against a grace of 60 s was accepted, and the
        # firing dropped as late (review of the scheduler).
        if self.redispatch_after_s + REDISPATCH_TICKS * self.tick_s > self.grace_s:
            raise ValueError(
                f"SCHEDULER_REDISPATCH_S ({self.redispatch_after_s:g}) plus "
                f"{REDISPATCH_TICKS} SCHEDULER_TICK_S ({self.tick_s:g}) must be within "
                f"SCHEDULER_GRACE_S ({self.grace_s:g}): a firing whose publish failed would "
                "be late by the time it is published again, and dropped under policy skip"
            )
        return self

    @model_validator(mode="after")
    def _a_claim_is_sent_before_it_is_taken_for_lost(self) -> Self:
        """A firing stays `claimed` from its claim's stamp until it is marked sent: the
        claim's insert (up to `MONGO_TIMEOUT_S`), its publish (up to `BROKER_TIMEOUT_S`)
        and the mark (up to `MONGO_TIMEOUT_S` again). Another replica publishes a claim left
        that way for `SCHEDULER_REDISPATCH_S`: any shorter, an ordinary slow publish was
        taken for a lost one and the fire time ran twice."""
        sending = self.broker_timeout_s + 2 * self.mongo_timeout_s
        if sending >= self.redispatch_after_s:
            raise ValueError(
                f"SCHEDULER_REDISPATCH_S ({self.redispatch_after_s:g}) must exceed "
                f"BROKER_TIMEOUT_S ({self.broker_timeout_s:g}) plus twice MONGO_TIMEOUT_S "
                f"({self.mongo_timeout_s:g}), the longest a firing takes from its claim to "
                "being marked sent: another replica would publish a slow one again"
            )
        return self

    @model_validator(mode="after")
    def _a_live_run_is_never_taken_for_dead(self) -> Self:
        """A run writes a heartbeat when each delivery starts and when each retry is
        recorded: a delivery is held at most the broker's consumer timeout, and the next
        one comes after at most SCHEDULER_RETRY_CAP_S. A shorter limit abandoned live runs
        and let the next firing overlap them."""
        longest_silence = BROKER_CONSUMER_TIMEOUT_S + self.job_retry_cap_s
        if self.run_stale_s <= longest_silence:
            raise ValueError(
                f"SCHEDULER_RUN_STALE_S ({self.run_stale_s:g}) must exceed the broker's "
                f"consumer timeout ({BROKER_CONSUMER_TIMEOUT_S:g}) plus SCHEDULER_RETRY_CAP_S "
                f"({self.job_retry_cap_s:g}), the longest a live run goes without a sign of "
                "life: a live run would be taken for dead and its job run beside it"
            )
        return self

    @model_validator(mode="after")
    def _a_page_fits_the_backlog(self) -> Self:
        # A page is published only while the requests waiting plus the page stay within the
        # backlog: a page larger than the backlog never fits, so the fan-out never publishes.
        if self.fanout_max_backlog < self.fanout_page_size:
            raise ValueError(
                f"FANOUT_MAX_BACKLOG ({self.fanout_max_backlog}) must be at least "
                f"FANOUT_PAGE_SIZE ({self.fanout_page_size}): a full page would never fit "
                "under the backlog, and the re-score fan-out would never publish one"
            )
        return self

    @field_validator("rubric_version")
    @classmethod
    def _a_prompt_version(cls, value: str | None) -> str | None:
        return known_rubric_version(value)

    # Catalogue entries one page of the re-score fan-out reads, in `_id` order; it publishes
    # those of them due a re-score (all, at most).
    fanout_page_size: int = Field(
        default=1000, ge=1, le=10_000, validation_alias="FANOUT_PAGE_SIZE"
    )
    # Pages one delivery of a fan-out run walks before it continues in a new message, so no
    # single delivery stays unacknowledged for long (RabbitMQ's consumer timeout).
    fanout_pages_per_delivery: int = Field(
        default=50, ge=1, le=MAX_FANOUT_PAGES, validation_alias="FANOUT_PAGES_PER_DELIVERY"
    )
    # Score and re-score requests waiting above which the fan-out waits before its next page
    # (its run waits it out as for a full queue): half the score queue, the rest left to
    # clients' submissions.
    fanout_max_backlog: int = Field(
        default=SCORE_QUEUE_MAX_LENGTH // 2,
        ge=1,
        le=SCORE_QUEUE_MAX_LENGTH,
        validation_alias="FANOUT_MAX_BACKLOG",
    )
    # How far back the re-score fan-out reaches: tasks first completed longer ago are not
    # requested. Set it to the gateway's IDEMPOTENCY_TTL_S: the gateway re-scores a task from
    # its submission, kept that long from when the task was due (at or before its first
    # completion; a re-score does not extend it),
    # and answers a request for an older one "unknown task", after two round trips to its
    # database, each request counted against FANOUT_MAX_BACKLOG meanwhile.
    # (At most ten years.) The catalogue keeps a task this long and a day, unless
    # `catalogue_retention_days` says otherwise (`config.catalogue_retention`).
    fanout_horizon_s: int = Field(
        default=86_400, gt=0, le=MAX_DURATION_S, validation_alias="FANOUT_HORIZON_S"
    )
