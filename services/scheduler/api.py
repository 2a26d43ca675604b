"""The scheduler's HTTP routes: cron administration and the daily usage read model.

    GET  /admin/v1/cron/jobs                 every job: schedule, next fire time, last firing
    POST /admin/v1/cron/jobs/{name}/run      fire a job by hand -> 202 {run_id, ...}
    GET  /admin/v1/cron/runs/{run_id}        one firing's state
    GET  /internal/v1/usage?tenant_id=&from=&to=
                                             daily usage rows of a tenant (UTC days, inclusive)

Not for the public: the gateway answers `GET /v1/usage` from the internal route, and the
admin routes are for operators (`scorebox cron ...`), with `Authorization: Bearer <ADMIN_API_KEY>`.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import date, datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Query, Response
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from services.scheduler.cron import zone
from services.scheduler.errors import DispatchFailed, TriggeredTooOften, UnknownJob
from services.scheduler.firings import Firing, FiringStore
from services.scheduler.jobs import Clock
from services.scheduler.metering import NANOS_PER_UNIT
from services.scheduler.schedule import JobCatalog, ScheduledJob
from services.scheduler.usage_store import DailyUsage, DailyUsageStore
from shared.http import Problem, admin_guard, parse_day

log = logging.getLogger("scorebox.scheduler.api")

MAX_USAGE_RANGE_DAYS = 366
TriggerJob = Callable[[str], Awaitable[Firing]]


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class FiringView(_Out):
    run_id: str
    job: str
    scheduled_for: datetime
    fired_at: datetime
    manual: bool
    state: str
    attempts: int
    missed: int = Field(description="Fire times folded into this one (coalesce) or skipped.")
    finished_at: datetime | None
    next_attempt_at: datetime | None
    result: dict[str, Any] | None
    error: str | None

    @classmethod
    def of(cls, firing: Firing) -> FiringView:
        return cls(
            run_id=firing.run_id,
            job=firing.job,
            scheduled_for=firing.scheduled_for,
            fired_at=firing.fired_at,
            manual=firing.manual,
            state=firing.state.value,
            attempts=firing.attempts,
            missed=firing.missed,
            finished_at=firing.finished_at,
            next_attempt_at=firing.next_attempt_at,
            result=firing.result,
            error=firing.error,
        )


class JobView(_Out):
    name: str
    description: str
    cron: str
    tz: str
    missed: str = Field(description="Policy for missed firings: coalesce or skip.")
    enabled: bool
    next_fire_at: datetime | None = Field(description="UTC; None when disabled.")
    next_fire_local: str | None = Field(description="The same instant on the job's wall clock.")
    last_firing: FiringView | None


class JobList(_Out):
    jobs: list[JobView]


class RunAccepted(_Out):
    run_id: str
    job: str
    state: str
    scheduled_for: datetime
    status_url: str


class DailyUsageView(_Out):
    date: str = Field(examples=["2025-01-31"])
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost: float | None = Field(description="None when no request of the day had a price.")
    unpriced_requests: int = Field(description="Requests whose model has no configured price.")

    @classmethod
    def of(cls, row: DailyUsage) -> DailyUsageView:
        return cls(
            date=row.day,
            requests=row.requests,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            total_tokens=row.total_tokens,
            cost=row.cost_nanos / NANOS_PER_UNIT if row.priced_requests else None,
            unpriced_requests=row.unpriced_requests,
        )


class UsageTotals(_Out):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost: float | None
    unpriced_requests: int


class UsageReport(_Out):
    tenant_id: str
    from_: str = Field(serialization_alias="from")
    to: str
    currency: str
    days: list[DailyUsageView] = Field(description="Days with usage only, ascending.")
    totals: UsageTotals


def _job_view(job: ScheduledJob, last: Firing | None, now: datetime) -> JobView:
    next_fire = job.next_fire_time(now) if job.enabled else None
    local = None if next_fire is None else next_fire.astimezone(zone(job.tz)).isoformat()
    return JobView(
        name=job.name,
        description=job.description,
        cron=job.cron,
        tz=job.tz,
        missed=job.missed.value,
        enabled=job.enabled,
        next_fire_at=next_fire,
        next_fire_local=local,
        last_firing=None if last is None else FiringView.of(last),
    )


def cron_routes(
    *,
    jobs: JobCatalog,
    firings: FiringStore,
    trigger: TriggerJob,
    clock: Clock,
    admin_key: SecretStr | None,
) -> APIRouter:
    router = APIRouter(
        prefix="/admin/v1/cron", tags=["cron"], dependencies=[admin_guard(admin_key)]
    )

    @router.get("/jobs", response_model=JobList)
    async def list_jobs() -> JobList:
        now = clock()
        return JobList(jobs=[_job_view(job, await firings.latest(job.name), now) for job in jobs])

    @router.post("/jobs/{name}/run", status_code=202, response_model=RunAccepted)
    async def run_job(name: str, response: Response) -> RunAccepted:
        try:
            firing = await trigger(name)
        except UnknownJob as error:
            raise Problem(404, str(error), kind="unknown-job") from error
        except TriggeredTooOften as error:
            raise Problem(429, str(error), headers={"Retry-After": "1"}) from error
        except DispatchFailed as error:
            raise Problem(503, str(error), kind="broker-unavailable") from error
        status_url = f"/admin/v1/cron/runs/{firing.run_id}"
        response.headers["Location"] = status_url
        return RunAccepted(
            run_id=firing.run_id,
            job=firing.job,
            state=firing.state.value,
            scheduled_for=firing.scheduled_for,
            status_url=status_url,
        )

    @router.get("/runs/{run_id}", response_model=FiringView)
    async def read_run(run_id: str) -> FiringView:
        firing = await firings.find(run_id)
        if firing is None:
            raise Problem(404, f"No cron run {run_id!r} is known (or it has expired).")
        return FiringView.of(firing)

    return router


def usage_range(first: str, last: str) -> tuple[date, date]:
    """The inclusive day range of a usage query; raises a 422 `Problem` when it is unusable."""
    first_day, last_day = parse_day(first, "from"), parse_day(last, "to")
    if last_day < first_day:
        raise Problem(422, "`to` must not be before `from`.", kind="invalid-fields")
    if last_day - first_day >= timedelta(days=MAX_USAGE_RANGE_DAYS):
        raise Problem(
            422,
            f"A usage query spans at most {MAX_USAGE_RANGE_DAYS} days.",
            kind="invalid-fields",
        )
    return first_day, last_day


def _totals(rows: list[DailyUsage]) -> UsageTotals:
    priced = sum(row.priced_requests for row in rows)
    return UsageTotals(
        requests=sum(row.requests for row in rows),
        prompt_tokens=sum(row.prompt_tokens for row in rows),
        completion_tokens=sum(row.completion_tokens for row in rows),
        total_tokens=sum(row.total_tokens for row in rows),
        cost=sum(row.cost_nanos for row in rows) / NANOS_PER_UNIT if priced else None,
        unpriced_requests=sum(row.unpriced_requests for row in rows),
    )


def usage_routes(*, daily: DailyUsageStore, currency: str) -> APIRouter:
    router = APIRouter(prefix="/internal/v1", tags=["usage"])

    @router.get("/usage", response_model=UsageReport, response_model_by_alias=True)
    async def read_usage(
        tenant_id: Annotated[str, Query(min_length=1, max_length=200)],
        from_: Annotated[str, Query(alias="from")],
        to: Annotated[str, Query()],
    ) -> UsageReport:
        first_day, last_day = usage_range(from_, to)
        rows = await daily.read(
            tenant_id, first_day=first_day.isoformat(), last_day=last_day.isoformat()
        )
        return UsageReport(
            tenant_id=tenant_id,
            from_=first_day.isoformat(),
            to=last_day.isoformat(),
            currency=currency,
            days=[DailyUsageView.of(row) for row in rows],
            totals=_totals(rows),
        )

    return router
