"""What every cron job shares: the run it is given and the outcome it returns.

A job handler is a plain async function `(run) -> JobOutcome`; the composition root binds its
dependencies (keyword-only) with `functools.partial`. Handlers know nothing of the broker:
they raise `PermanentJobError` / `TransientJobError` (or anything else, counted as transient)
and the consumer decides what that means.
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


@dataclass(frozen=True)
class JobOutcome:
    """What a run did (`summary`, kept on the firing) and whether it must go on (`more`)."""

    summary: dict[str, Any] = field(default_factory=dict)
    more: bool = False


JobHandler = Callable[[JobRun], Awaitable[JobOutcome]]
