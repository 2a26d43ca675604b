"""What can go wrong in the scheduler, split by what the caller must do.

    SchedulerError
    ├── ConfigurationError      refuse to start: a bad cron expression, time zone, policy,
    │                           price, a configured job without a handler, or an enabled
    │                           job its settings leave unable to run
    ├── UnknownJob              404 on the admin routes; a `RunCronJob` naming it waits for
    │                           a replica that knows it (a rolling deploy), then is
    │                           dead-lettered (`runs.UNKNOWN_JOB_MAX_WAIT`)
    ├── JobNotRunnable          a manual run of a job its settings leave unable to run (the
    │                           fan-out without `RUBRIC_VERSION`): 409, nothing kept
    ├── DispatchFailed          a manual run could not be published: 503, nothing kept
    ├── TriggeredTooOften       manual runs of one job collide on their key: 429
    ├── RunInProgress           a manual run of a job that forbids overlapping runs while
    │                           one is in progress: 409 (a replay keeps its letter)
    ├── ReplayRefused           dead letters of jobs no longer configured: 409, nothing
    │                           replayed, every letter kept
    └── JobError                raised by a job handler
        ├── PermanentJobError   dead-letter the run now: retrying fails the same way
        └── TransientJobError   retry the run with back-off, then dead-letter
            └── DownstreamFull  a queue the job feeds is full: wait for room, attempts
                                not counted, for up to `DOWNSTREAM_FULL_MAX_WAIT`

Any other exception from a job counts as transient: a run is retried a bounded number of
times (`SCHEDULER_JOB_MAX_ATTEMPTS`) before it is dead-lettered with the error as reason.
"""

from __future__ import annotations

from datetime import datetime

from shared.contracts import rfc3339
from shared.http import quoted
from shared.settings import StartupRefused


class SchedulerError(Exception):
    """Base of the scheduler's own errors."""


class ConfigurationError(SchedulerError, StartupRefused):
    """The schedule or the job configuration is unusable; the service must not start."""


class UnknownJob(SchedulerError):
    """No job of that name is configured."""

    def __init__(self, name: str) -> None:
        super().__init__(f"No cron job named {quoted(name)} is configured.")
        self.name = name


class JobNotRunnable(SchedulerError):
    """A job its settings leave unable to run (`ScheduledJob.cannot_run`) asked to run."""

    def __init__(self, name: str, why: str) -> None:
        super().__init__(f"Cron job {name!r} cannot run here: {why}. Nothing was started.")
        self.name = name


class DispatchFailed(SchedulerError):
    """A manual firing could not be published; it was withdrawn."""


class DispatchUnknown(DispatchFailed):
    """A manual firing could not be published, nor withdrawn, nor read back: it may run
    later (the dispatcher publishes a claim left standing), so it must not be retried."""

    def __init__(self, message: str, *, run_id: str) -> None:
        super().__init__(message)
        self.run_id = run_id


class TriggeredTooOften(SchedulerError):
    """Manual runs of one job came faster than their keys (a millisecond each) allow."""

    def __init__(self, name: str) -> None:
        super().__init__(f"Cron job {name!r} is being triggered too often; try again.")
        self.name = name


class RunInProgress(SchedulerError):
    """A job that forbids overlapping runs has one in progress (not silent for long)."""

    def __init__(self, job: str, run_id: str, state: str, since: datetime | None) -> None:
        heard = "" if since is None else f", last heard of at {rfc3339(since)}"
        super().__init__(
            f"Cron job {job!r} forbids overlapping runs and run {run_id} is in progress "
            f"({state}{heard}); try again once it has ended."
        )
        self.job = job
        self.run_id = run_id


class ReplayRefused(SchedulerError):
    """A replay asked for dead letters whose jobs are no longer configured."""

    def __init__(self, runs: dict[str, str]) -> None:
        listed = ", ".join(f"{run_id} ({job!r})" for run_id, job in runs.items())
        super().__init__(
            "Dead-lettered runs of jobs no longer configured, or that their settings leave "
            f"unable to run, cannot be run again: {listed}. "
            "Nothing was replayed and every letter is kept; replay the others by run id or "
            "all of them (which skips these), and drop these (`scorebox cron dlq drop RUN_ID`)."
        )
        self.runs = runs  # run id -> job


class JobError(SchedulerError):
    """A job run failed."""


class PermanentJobError(JobError):
    """Retrying cannot help (missing configuration, impossible input): dead-letter now."""


class TransientJobError(JobError):
    """The run may succeed later (a dependency is unavailable): retry with back-off."""


class DownstreamFull(TransientJobError):
    """A queue the job feeds refused its messages (full): back-pressure, not a failure."""
