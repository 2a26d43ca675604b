"""The scheduler's job configuration: `config/scheduler.toml` plus environment overrides.

The file names each job's cron expression, time zone, missed-firing policy, concurrency
policy and whether it is enabled, the model prices of the usage rollup, and retention and
alert thresholds. For a job `usage-rollup` the environment may override `CRON_USAGE_ROLLUP`
(the expression), `CRON_USAGE_ROLLUP_TZ`, `CRON_USAGE_ROLLUP_ENABLED` and
`CRON_USAGE_ROLLUP_CONCURRENCY`. Everything is validated at start-up:
a bad expression, zone, policy or price refuses to start (`ConfigurationError`).
"""

from __future__ import annotations

import logging
import re
import tomllib
from collections.abc import Mapping
from datetime import UTC, datetime, timedelta
from decimal import Decimal
from enum import StrEnum
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    field_validator,
    model_validator,
)

from services.scheduler.cron import next_fire_time, validate_spec, zone
from services.scheduler.errors import ConfigurationError
from shared.settings import MAX_DURATION_S, refusals

log = logging.getLogger("scorebox.scheduler.config")

DEFAULT_CONFIG_PATH = Path(__file__).resolve().parents[2] / "config" / "scheduler.toml"

_ENABLED_WORDS = {"1": True, "true": True, "yes": True, "0": False, "false": False, "no": False}


class MissedFirings(StrEnum):
    """What a job does about fire times that passed while no scheduler ran."""

    COALESCE = "coalesce"  # run once, for the latest of them
    SKIP = "skip"  # run none of them (record the latest as skipped)


class Concurrency(StrEnum):
    """Whether a run of a job may start while another run of it is in progress (Kubernetes
    CronJob's `concurrencyPolicy`, without `Replace`: our jobs resume from where they stand,
    and replacing a fan-out half-way would start its walk of the catalogue again)."""

    # A fire time that comes while a run of the job is in progress is recorded as skipped
    # ("overlap"), and a manual run is refused (409): a roll-up or fan-out whose chain of
    # slices outlasts its period otherwise starts a second chain on the same work.
    FORBID = "forbid"
    ALLOW = "allow"  # every firing runs, beside any run in progress


class _Strict(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class JobConfig(_Strict):
    cron: str
    tz: str = "UTC"
    missed: MissedFirings = MissedFirings.COALESCE
    concurrency: Concurrency = Concurrency.FORBID
    enabled: bool = True
    description: str = ""

    @field_validator("cron")
    @classmethod
    def _valid_cron(cls, value: str) -> str:
        try:
            return validate_spec(value)
        except ConfigurationError as error:
            raise ValueError(str(error)) from error

    @field_validator("tz")
    @classmethod
    def _valid_zone(cls, value: str) -> str:
        try:
            zone(value)
        except ConfigurationError as error:
            raise ValueError(str(error)) from error
        return value

    @model_validator(mode="after")
    def _fires_again(self) -> JobConfig:
        # croniter accepts dates that never come (`0 0 30 2 *`) and years already past.
        now = datetime.now(UTC)
        if next_fire_time(self.cron, self.tz, now) is None:
            raise ValueError(f"cron expression {self.cron!r} never fires after {now:%Y-%m-%d} UTC")
        return self


class Price(_Strict):
    """A model's price in the configured currency per 1,000 tokens."""

    prompt_per_1k: Decimal = Field(ge=0)
    completion_per_1k: Decimal = Field(ge=0)


# The longest retention in days (`MAX_DURATION_S`, ten years): a million days was taken, and
# `now - timedelta(days=...)` then raised OverflowError in every housekeeping run and every
# usage rollup slice (each dead-lettered after its retries), and nothing expired again.
MAX_RETENTION_DAYS = MAX_DURATION_S // 86_400


class UsageConfig(_Strict):
    currency: str = "USD"
    # Raw usage records older than this (and already rolled up) are deleted by housekeeping;
    # a late record for a day older than this is not rolled up (its day can no longer be
    # recomputed in full).
    raw_retention_days: int = Field(default=90, ge=2, le=MAX_RETENTION_DAYS)


class HousekeepingConfig(_Strict):
    firing_retention_days: int = Field(default=30, ge=1, le=MAX_RETENTION_DAYS)
    # Unset: the fan-out horizon (`FANOUT_HORIZON_S`) and a day, `catalogue_retention`.
    catalogue_retention_days: int | None = Field(default=None, ge=1, le=MAX_RETENTION_DAYS)
    dead_letter_threshold: int = Field(default=1, ge=1)


# What the catalogue keeps past the fan-out horizon by default: a task completed within the
# horizon when a run started is still there when its page is read.
CATALOGUE_MARGIN = timedelta(days=1)


def catalogue_retention(housekeeping: HousekeepingConfig, *, horizon: timedelta) -> timedelta:
    """How long the re-score catalogue keeps a completed task. Only the fan-out reads it,
    and only tasks completed within its horizon are due: kept a year by default, each daily
    run walked 365 times the entries it could use (review of the scheduler)."""
    if housekeeping.catalogue_retention_days is None:
        return horizon + CATALOGUE_MARGIN
    return timedelta(days=housekeeping.catalogue_retention_days)


class SchedulerConfig(_Strict):
    jobs: dict[str, JobConfig] = Field(default_factory=dict)
    prices: dict[str, Price] = Field(default_factory=dict)
    usage: UsageConfig = Field(default_factory=UsageConfig)
    housekeeping: HousekeepingConfig = Field(default_factory=HousekeepingConfig)


def env_name(job: str) -> str:
    """`usage-rollup` -> `CRON_USAGE_ROLLUP`."""
    return "CRON_" + job.upper().replace("-", "_").replace(".", "_")


def _with_overrides(data: Mapping[str, Any], environ: Mapping[str, str]) -> dict[str, Any]:
    """`data` with the jobs' settings from the environment. A `jobs` that is no table of
    tables (`[[jobs]]`, `usage-rollup = "5 * * * *"` under `[jobs]`) is refused naming what
    it must be: copied as tables, it stopped the start with a traceback naming neither
    (found in review)."""
    jobs = {name: dict(job) for name, job in _job_tables(data.get("jobs", {})).items()}
    _refuse_shared_variables(jobs)
    _warn_of_unknown_variables(jobs, environ)
    for name, job in jobs.items():
        prefix = env_name(name)
        if spec := environ.get(prefix):
            job["cron"] = spec
        if tz := environ.get(f"{prefix}_TZ"):
            job["tz"] = tz
        if (enabled := environ.get(f"{prefix}_ENABLED")) is not None:
            if enabled.strip().lower() not in _ENABLED_WORDS:
                raise ConfigurationError(f"{prefix}_ENABLED must be true or false")
            job["enabled"] = _ENABLED_WORDS[enabled.strip().lower()]
        if concurrency := environ.get(f"{prefix}_CONCURRENCY"):
            job["concurrency"] = concurrency.strip().lower()
    return {**data, "jobs": jobs}


def _refuse_shared_variables(jobs: Mapping[str, object]) -> None:
    """Two jobs whose names differ only by `-`, `_`, `.` or case would take each other's
    `CRON_<JOB>` overrides: one variable set meant for one moved both (a review)."""
    named: dict[str, str] = {}
    for name in jobs:
        other = named.setdefault(env_name(name), name)
        if other != name:
            raise ConfigurationError(
                f"invalid scheduler configuration: jobs {other!r} and {name!r} would share "
                f"the variables {env_name(name)}, {env_name(name)}_TZ, ...; rename one"
            )


# The variables each job may be overridden by: `CRON_<JOB>` and these suffixes.
_OVERRIDE_SUFFIXES = ("", "_TZ", "_ENABLED", "_CONCURRENCY")
# What Kubernetes sets in every pod for a Service named `cron` (or `cron-...`): no override.
_SERVICE_LINKS = re.compile(r"^CRON(_[A-Z0-9_]+)?_(SERVICE_HOST|SERVICE_PORT(_\w+)?|PORT(_\w+)?)$")


def _warn_of_unknown_variables(jobs: Mapping[str, object], environ: Mapping[str, str]) -> None:
    """A `CRON_` variable, not empty, that overrides no configured job is named in a warning:
    a typo (`CRON_USAGE_ROLLUP_ENABLE=false`, `CRON_USAGEROLLUP=5 * * * *`) started the
    scheduler with the job as configured, and the operator took it for disabled or moved (a
    walkthrough). Not refused: compose passes `CRON_RESCORE_FANOUT_ENABLED=false` to a
    schedule that may have no such job, and Kubernetes sets `CRON_SERVICE_HOST` and the like
    for a Service named `cron` (a review); those are not named either."""
    known = {env_name(name) + suffix for name in jobs for suffix in _OVERRIDE_SUFFIXES}
    unknown = sorted(
        name
        for name, value in environ.items()
        if name.startswith("CRON_")
        and value.strip()
        and name not in known
        and not _SERVICE_LINKS.match(name)
    )
    if unknown:
        log.warning(
            "%s: no configured job has such a variable, so it changes nothing (the jobs: %s; "
            "each takes CRON_<JOB>, ..._TZ, ..._ENABLED and ..._CONCURRENCY, <JOB> its name "
            "upper-cased with '-' and '.' as '_')",
            ", ".join(unknown),
            ", ".join(sorted(jobs)) or "none",
        )


def _job_tables(given: object) -> Mapping[str, Mapping[str, Any]]:
    shape = '[jobs.<name>] tables, each with cron = "..."'
    if not isinstance(given, Mapping):
        raise ConfigurationError(
            f"invalid scheduler configuration: jobs must be {shape}, not {_toml_kind(given)}"
        )
    for name, job in given.items():
        if not isinstance(job, Mapping):
            raise ConfigurationError(
                f"invalid scheduler configuration: jobs.{name} must be one of the {shape}, "
                f"not {_toml_kind(job)}"
            )
    return given


def _toml_kind(value: object) -> str:
    return "an array" if isinstance(value, list) else f"a {type(value).__name__} value"


def parse_config(data: Mapping[str, Any], environ: Mapping[str, str]) -> SchedulerConfig:
    """Validate a parsed TOML document after applying the environment overrides."""
    try:
        return SchedulerConfig.model_validate(_with_overrides(data, environ))
    except ValidationError as error:
        described = "; ".join(refusals(error))
        raise ConfigurationError(f"invalid scheduler configuration: {described}") from error


def load_config(path: Path, environ: Mapping[str, str]) -> SchedulerConfig:
    """Read and validate the TOML file at `path` with the environment overrides."""
    try:
        with path.open("rb") as file:
            data = tomllib.load(file)
    except FileNotFoundError as error:
        raise ConfigurationError(
            f"scheduler configuration {path} not found (set SCHEDULER_CONFIG)"
        ) from error
    except tomllib.TOMLDecodeError as error:
        raise ConfigurationError(f"{path} is not valid TOML: {error}") from error
    except UnicodeDecodeError as error:
        raise ConfigurationError(f"{path} is not UTF-8 text (TOML is): {error}") from error
    except OSError as error:  # a directory, a file it may not read
        raise ConfigurationError(f"scheduler configuration {path} unreadable: {error}") from error
    return parse_config(data, environ)
