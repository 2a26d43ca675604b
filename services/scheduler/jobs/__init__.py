"""What every cron job shares: the run it is given and the outcome it returns.

A job handler is a plain async function `(run) -> JobOutcome`; the composition root binds its
dependencies (keyword-only) with `functools.partial`. Handlers know nothing of the broker:
they raise `PermanentJobError` / `TransientJobError` (or anything else, counted as transient)
and the consumer decides what that means.

A job that works in steps (the fan-out's pages) takes no new step once its delivery's time for
steps is spent (`JobRun.work_until`) and returns `more`: the delivery's database deadline
covers the whole handler, so a step begun late failed on that deadline however healthy the
database, and the run was counted a failed attempt although it had moved on.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

Clock = Callable[[], datetime]


@dataclass(frozen=True)
class JobRun:
    """One delivery of one firing of a job."""

    run_id: str
    job: str
    scheduled_for: datetime
    fired_at: datetime
    manual: bool
    attempt: int
    slice: int = 0
    # When this delivery's time for taking more steps ends (None: no limit): the share of its
    # database deadline a job that works in steps may spend on them (`runs.STEP_SHARE`).
    work_until: datetime | None = None

    def out_of_time(self, now: datetime) -> bool:
        """Whether a job that works in steps should take no new one at `now`."""
        return self.work_until is not None and now >= self.work_until


@dataclass(frozen=True)
class JobOutcome:
    """What a run did (`summary`, kept on the firing) and whether it must go on (`more`)."""

    summary: dict[str, Any] = field(default_factory=dict)
    more: bool = False


JobHandler = Callable[[JobRun], Awaitable[JobOutcome]]
