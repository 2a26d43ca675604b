"""Which firing of a job is due now, and what becomes of missed ones: pure policy.

For each job the dispatcher knows the last fire time it (or another replica) recorded; the
fire times since then up to now are due. Of several due fire times only the latest runs
(one run per job per tick). Fire times that passed while no scheduler was running follow the
job's policy:

- `coalesce` (default): the latest due fire time runs, however late; the earlier ones are
  folded into it (`missed` counts them).
- `skip`: the latest runs only if it is at most `grace` old; otherwise none runs and the
  latest is recorded as skipped, which moves the job past all of them.

A job with no recorded firing has no history to catch up on: fire times within `grace`
before now are due, older ones are not.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta

from services.scheduler.config import Concurrency, JobConfig, MissedFirings
from services.scheduler.cron import latest_fire_time, next_fire_time, next_fire_times
from services.scheduler.errors import UnknownJob

# Beyond this many due fire times the count is not exact (`missed` saturates); the latest
# fire time is still found exactly.
MISSED_COUNT_CAP = 1000


@dataclass(frozen=True)
class ScheduledJob:
    name: str
    cron: str
    tz: str
    missed: MissedFirings
    enabled: bool
    description: str = ""
    concurrency: Concurrency = Concurrency.FORBID
    # Why the job cannot run here (a setting it needs is missing); None when it can.
    cannot_run: str | None = None

    @property
    def forbids_overlap(self) -> bool:
        return self.concurrency is Concurrency.FORBID

    @classmethod
    def from_config(
        cls, name: str, config: JobConfig, *, cannot_run: str | None = None
    ) -> ScheduledJob:
        return cls(
            name=name,
            cron=config.cron,
            tz=config.tz,
            missed=config.missed,
            enabled=config.enabled,
            description=config.description,
            concurrency=config.concurrency,
            cannot_run=cannot_run,
        )

    def next_fire_time(self, after: datetime) -> datetime | None:
        return next_fire_time(self.cron, self.tz, after)


@dataclass(frozen=True)
class FiringPlan:
    """`run`: the fire time to run now; `skip`: the fire time to record as skipped."""

    run: datetime | None = None
    skip: datetime | None = None
    missed: int = 0

    @property
    def is_empty(self) -> bool:
        return self.run is None and self.skip is None


def plan_firings(
    job: ScheduledJob, *, last: datetime | None, now: datetime, grace: timedelta
) -> FiringPlan:
    """What to do for `job` at `now`, given the last recorded fire time `last`."""
    after = last if last is not None else now - grace
    due = next_fire_times(job.cron, job.tz, after, now, limit=MISSED_COUNT_CAP + 1)
    if not due:
        return FiringPlan()
    latest = due[-1] if len(due) <= MISSED_COUNT_CAP else latest_fire_time(job.cron, job.tz, now)
    earlier = min(len(due), MISSED_COUNT_CAP + 1) - 1
    if job.missed is MissedFirings.COALESCE or now - latest <= grace:
        return FiringPlan(run=latest, missed=earlier)
    return FiringPlan(skip=latest, missed=earlier + 1)


class JobCatalog:
    """The configured jobs, by name, in configuration order."""

    def __init__(self, jobs: Iterable[ScheduledJob]) -> None:
        self._jobs = {job.name: job for job in jobs}

    @classmethod
    def from_config(
        cls, jobs: Mapping[str, JobConfig], *, cannot_run: Mapping[str, str] | None = None
    ) -> JobCatalog:
        """`cannot_run`: why jobs, by name, cannot run here (a setting they need missing)."""
        why = cannot_run or {}
        return cls(
            ScheduledJob.from_config(name, config, cannot_run=why.get(name))
            for name, config in jobs.items()
        )

    def __iter__(self) -> Iterator[ScheduledJob]:
        return iter(self._jobs.values())

    def __contains__(self, name: object) -> bool:
        return name in self._jobs

    def get(self, name: str) -> ScheduledJob:
        try:
            return self._jobs[name]
        except KeyError:
            raise UnknownJob(name) from None

    def runnable(self, name: str) -> bool:
        """Whether `name` is configured and its settings let it run."""
        job = self._jobs.get(name)
        return job is not None and job.cannot_run is None

    @property
    def names(self) -> list[str]:
        return list(self._jobs)

    @property
    def enabled(self) -> list[ScheduledJob]:
        return [job for job in self._jobs.values() if job.enabled]
