"""The scheduler's HTTP routes: cron administration and the daily usage read model.

    GET  /admin/v1/cron/jobs                 every job: schedule, next fire time, last firing
    POST /admin/v1/cron/jobs/{name}/run      fire a job by hand -> 202 {run_id, ...}; 409
                                             while a run of a job that forbids
                                             overlapping runs is in progress; 503 with
                                             Retry-After when the broker refused it (the
                                             run withdrawn); 202 `claimed` when refused
                                             but not withdrawn (it runs later)
    GET  /admin/v1/cron/runs/{run_id}        one firing's state
    GET  /admin/v1/cron/dead-letters         the cron-jobs DLQ, oldest first (not consumed),
                                             with the time of the listing (`listed_at`)
    POST /admin/v1/cron/dead-letters/replay  {run_ids: [...]} | {all: true}: each letter's
                                             job runs again as a new firing, then the
                                             letter leaves the DLQ
    DELETE /admin/v1/cron/dead-letters/{run_id}[?dead_lettered_before=<RFC 3339>]
                                             drop one run's letters (every copy), nothing
                                             run -> {run_id, removed, truncated}; 404, or
                                             409 when the walk stopped before reaching it;
                                             with a cut-off, only those known dead-lettered
                                             before it (+ kept: n)
    DELETE /admin/v1/cron/dead-letters[?dead_lettered_before=<RFC 3339>]
                                             purge -> {purged: n}; with a cut-off, a walk
                                             -> {purged, kept, truncated}
    GET  /internal/v1/usage?tenant_id=&from=&to=
                                             daily usage rows of a tenant (UTC days, inclusive)

Not for the public: the gateway answers `GET /v1/usage` from the internal route, with
`Authorization: Bearer <INTERNAL_API_KEY>` when that is set, and the admin routes are for
operators (`scorebox cron ...`), with `Authorization: Bearer <ADMIN_API_KEY>`. Neither key
opens the other's routes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import asdict
from datetime import date, datetime, timedelta
from typing import Annotated, Any, Final

from fastapi import APIRouter, Query, Request, Response
from pydantic import BaseModel, ConfigDict, Field, SecretStr, StrictBool, model_validator

from services.scheduler.cron import zone
from services.scheduler.dead_letters import CronDeadLetters
from services.scheduler.errors import (
    DispatchFailed,
    DispatchUnknown,
    JobNotRunnable,
    ReplayRefused,
    RunInProgress,
    TriggeredTooOften,
    UnknownJob,
)
from services.scheduler.firings import Firing, FiringStore, LeaseTaken
from services.scheduler.jobs import Clock
from services.scheduler.metering import NANOS_PER_UNIT
from services.scheduler.schedule import JobCatalog, ScheduledJob
from services.scheduler.usage_store import DailyUsage, DailyUsageStore
from shared.bodies import json_body, read_model, refuse_a_body
from shared.bus import BROKER_ERRORS
from shared.contracts import Instant
from shared.dead_letters import (
    CUT_OFF,
    REPLAY_BODY_LIMIT,
    REPLAY_BUDGET_S,
    WALK_BOUND,
    WALK_BUDGET_S,
    CutOffQuery,
    PurgeReport,
    nothing_dropped,
    purge_report,
)
from shared.http import (
    ADMIN_PROBLEMS,
    DATABASE_REFUSED_PROBLEM,
    INTERNAL_PROBLEMS,
    Problem,
    admin_guard,
    internal_guard,
    invalid_query,
    parse_day,
    problem,
    problem_responses,
    quoted,
)

log = logging.getLogger("scorebox.scheduler.api")

MAX_USAGE_RANGE_DAYS = 366
TriggerJob = Callable[[str], Awaitable[Firing]]
# When a client may ask again after the broker refused a request.
RETRY_AFTER_BROKER = {"Retry-After": "5"}


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class FiringView(_Out):
    run_id: str
    job: str
    scheduled_for: Instant
    fired_at: Instant
    manual: bool
    state: str
    attempts: int
    missed: int = Field(description="Fire times folded into this one (coalesce) or skipped.")
    finished_at: Instant | None
    next_attempt_at: Instant | None
    result: dict[str, Any] | None
    error: str | None
    replay_of: str | None = Field(description="The dead-lettered run this one replays.")
    replayed_as: str | None = Field(
        default=None, description="The run that replays this one (read of one run only)."
    )

    @classmethod
    def of(cls, firing: Firing, *, replayed_as: str | None = None) -> FiringView:
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
            replay_of=firing.replay_of,
            replayed_as=replayed_as,
        )


class JobView(_Out):
    name: str
    description: str
    cron: str
    tz: str
    missed: str = Field(description="Policy for missed firings: coalesce or skip.")
    concurrency: str = Field(
        description="forbid: no run starts while another is in progress; allow: every one."
    )
    enabled: bool
    next_fire_at: Instant | None = Field(description="UTC; None when disabled.")
    next_fire_local: str | None = Field(description="The same instant on the job's wall clock.")
    last_firing: FiringView | None


class JobList(_Out):
    jobs: list[JobView]


class RunAccepted(_Out):
    run_id: str
    job: str
    state: str = Field(
        description="dispatched: sent (or started); claimed: the broker refused it and it "
        "could not be withdrawn, so it is sent again after SCHEDULER_REDISPATCH_S and runs: "
        "asking again would start a second run."
    )
    scheduled_for: Instant
    status_url: str


class DailyUsageView(_Out):
    date: str = Field(examples=["2025-01-31"])
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost: float | None = Field(
        description="Of the priced requests; None when the day's requests had no price."
    )
    unpriced_requests: int = Field(description="Requests whose model has no configured price.")

    @classmethod
    def of(cls, row: DailyUsage) -> DailyUsageView:
        return cls(
            date=row.day,
            requests=row.requests,
            prompt_tokens=row.prompt_tokens,
            completion_tokens=row.completion_tokens,
            total_tokens=row.total_tokens,
            cost=usage_cost(row.cost_nanos, requests=row.requests, priced=row.priced_requests),
            unpriced_requests=row.unpriced_requests,
        )


def usage_cost(cost_nanos: int, *, requests: int, priced: int) -> float | None:
    """The cost of `requests`, `priced` of them with a price: None (unknown) only when there
    were requests and none had a price. A period without requests costs 0: its `cost` was
    null, read as unknown (found in a walkthrough)."""
    if requests and not priced:
        return None
    return cost_nanos / NANOS_PER_UNIT


class UsageTotals(_Out):
    requests: int
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    cost: float | None = Field(
        description="Of the priced requests; None when the period's requests had no price, "
        "0 when it had none."
    )
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
        concurrency=job.concurrency.value,
        enabled=job.enabled,
        next_fire_at=next_fire,
        next_fire_local=local,
        last_firing=None if last is None else FiringView.of(last),
    )


# The answers of every cron route: the admin guard's, and its database away (a PyMongo
# error the problem handlers answer 503 `database-unavailable`).
CRON_PROBLEMS: dict[int | str, dict[str, Any]] = {
    **ADMIN_PROBLEMS,
    503: problem(
        503,
        "`database-unavailable`: the scheduler's database did not answer; try again after "
        "Retry-After.",
    ),
}
RUN_LOCATION: Final = {
    "Location": {"description": "The run's URL, to read its state.", "schema": {"type": "string"}}
}
RUN_PROBLEMS: dict[int | str, dict[str, Any]] = {
    202: {"headers": RUN_LOCATION},
    404: problem(404, "`unknown-job`: no cron job of that name is configured."),
    409: problem(
        409,
        "`run-in-progress`: the job forbids overlapping runs and one is in progress "
        "(`run_id`, `status_url`); nothing was started. Ask again once it has ended. Or "
        "`job-not-runnable`: the job's settings leave it unable to run here (the re-score "
        "fan-out without `RUBRIC_VERSION`); nothing was started.",
    ),
    429: problem(429, "Runs of the job asked faster than their keys allow; try again."),
    500: DATABASE_REFUSED_PROBLEM,
    503: problem(
        503,
        "`broker-unavailable`: the broker refused the run and it was withdrawn (nothing "
        "runs; one that could not be withdrawn is answered 202 `claimed` instead); or "
        "`run-outcome-unknown`: refused, and neither withdrawn nor read back (a partition), "
        "so it may still run: no Retry-After, `Location` names the run, read it before "
        "asking again; or "
        "`database-unavailable`: the database did not answer (the run may have been "
        "recorded: read the job's `last_firing` before asking again); or `lease-contended`: "
        "runs of the job took and gave up its lease at every try, nothing was started.",
        headers=RUN_LOCATION,
    ),
}


def _lease_contended(error: LeaseTaken) -> Problem:
    """The job's lease changed hands at every try (`LEASE_TRIES`): runs of it beginning
    and ending all the while. Nothing was started; asking again shortly is the cure (it
    was an unmapped error, a 500)."""
    return Problem(
        503,
        f"{error}, its lease changing hands at every try: ask again shortly",
        kind="lease-contended",
        headers={"Retry-After": "1"},
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
        prefix="/admin/v1/cron",
        tags=["cron"],
        dependencies=[admin_guard(admin_key)],
        responses=CRON_PROBLEMS,
    )

    @router.get("/jobs", response_model=JobList)
    async def list_jobs() -> JobList:
        now = clock()
        return JobList(jobs=[_job_view(job, await firings.latest(job.name), now) for job in jobs])

    @router.post(
        "/jobs/{name}/run", status_code=202, response_model=RunAccepted, responses=RUN_PROBLEMS
    )
    async def run_job(name: str, request: Request, response: Response) -> RunAccepted:
        await refuse_a_body(request, outcome="nothing was run")
        try:
            firing = await trigger(name)
        except UnknownJob as error:
            raise Problem(404, str(error), kind="unknown-job") from error
        except JobNotRunnable as error:
            raise Problem(409, str(error), kind="job-not-runnable") from error
        except TriggeredTooOften as error:
            raise Problem(429, str(error), headers={"Retry-After": "1"}) from error
        except RunInProgress as error:
            raise Problem(
                409,
                str(error),
                kind="run-in-progress",
                run_id=error.run_id,
                status_url=run_url(error.run_id),
            ) from error
        except DispatchUnknown as error:
            # No Retry-After: the run may go ahead, and a retry would run the job twice.
            raise Problem(
                503,
                f"{error}; read the run at its URL before running the job again.",
                kind="run-outcome-unknown",
                headers={"Location": run_url(error.run_id)},
            ) from error
        except DispatchFailed as error:
            raise Problem(
                503, str(error), kind="broker-unavailable", headers=RETRY_AFTER_BROKER
            ) from error
        except LeaseTaken as error:
            raise _lease_contended(error) from error
        status_url = run_url(firing.run_id)
        response.headers["Location"] = status_url
        return RunAccepted(
            run_id=firing.run_id,
            job=firing.job,
            state=firing.state.value,
            scheduled_for=firing.scheduled_for,
            status_url=status_url,
        )

    @router.get("/runs/{run_id}", response_model=FiringView, responses=problem_responses(404))
    async def read_run(run_id: str) -> FiringView:
        firing = await firings.find(run_id)
        if firing is None:
            raise Problem(404, f"No cron run {quoted(run_id)} is known (or it has expired).")
        replay = await firings.replayed_as(run_id)
        return FiringView.of(firing, replayed_as=None if replay is None else replay.run_id)

    return router


def run_url(run_id: str) -> str:
    return f"/admin/v1/cron/runs/{run_id}"


# What no walk sees: the letters another walk holds at that moment (each walk holds every
# letter it reaches until it ends).
OUT_OF_SIGHT = (
    "a letter another walk holds at that moment is out of sight: a walk of another scheduler "
    "replica, or the housekeeping job's dead-letter depth probe, which takes the head of the "
    "queue for a moment"
)


class CronDeadLetterView(_Out):
    message_id: str | None
    run_id: str | None
    job: str | None
    job_configured: bool = Field(
        description="False: the job is not configured, or its settings leave it unable to "
        "run (the fan-out without `RUBRIC_VERSION`); a replay naming it is refused (409): drop "
        "it by its run id, or set what it lacks."
    )
    scheduled_for: Instant | None = Field(description="As the dead message carries it.")
    fired_at: Instant | None
    manual: bool | None
    attempt: int | None
    slice: int | None
    reason: str
    queue: str
    dead_lettered_at: Instant | None
    body_preview: str


class CronDeadLetterList(_Out):
    count: int
    truncated: bool = Field(description="The walk stopped with letters left behind it.")
    listed_at: Instant = Field(
        description=f"When the listing was taken (before its walk): as `{CUT_OFF}`, a drop or "
        "a purge keeps the letters dead-lettered since."
    )
    items: list[CronDeadLetterView] = Field(description="Oldest dead-lettered first.")


class CronReplayRequest(BaseModel):
    """Which dead letters to replay: `run_ids`, or `all` (strict: "no" and 0 were read as
    false and "yes" as true)."""

    model_config = ConfigDict(extra="forbid")

    run_ids: list[str] = Field(default_factory=list, max_length=10_000)
    all: StrictBool = False

    @model_validator(mode="after")
    def _one_selection(self) -> CronReplayRequest:
        if self.all == bool(self.run_ids):
            raise ValueError("give either a non-empty `run_ids` or `all: true`")
        return self


class ReplayedRun(_Out):
    dead_run_id: str
    job: str
    run_id: str = Field(description="The new run (or the earlier replay, see started_now).")
    state: str
    status_url: str
    started_now: bool = Field(description="False: the run had been replayed already.")


class CronReplayReport(_Out):
    replayed: list[ReplayedRun]
    skipped_unreadable: list[str] = Field(description="Message ids of unreadable letters, kept.")
    skipped_unconfigured: list[str] = Field(
        description="Run ids of jobs no longer configured, or that their settings leave unable "
        "to run, kept (a replay of all skips them)."
    )
    not_found: list[str] = Field(
        description="Run ids asked for that no letter matched, the walk having reached the end "
        f"of the queue ({OUT_OF_SIGHT})."
    )
    skipped_in_progress: list[str] = Field(
        default_factory=list,
        description="Run ids of letters kept: their job forbids overlapping runs and has one "
        "in progress.",
    )
    not_reached: list[str] = Field(
        default_factory=list,
        description="Run ids asked for that no letter matched before the walk stopped at its "
        "bound (`truncated`): they may name letters past it (replay or drop letters before "
        "them, then ask again); and those whose letters the replay's budget left "
        "(`timed_out`: ask again).",
    )
    truncated: bool = Field(
        default=False,
        description=f"The walk stopped at its bound ({WALK_BOUND}) with letters left behind "
        "it: `all` replayed only the letters it reached; run ids it did not match are "
        "`not_reached`, never `not_found`.",
    )
    timed_out: bool = Field(
        default=False,
        description=f"The replay stopped at its {REPLAY_BUDGET_S:.0f} s budget with letters "
        "it had chosen left in the queue: ask again for the rest.",
    )
    interrupted: str | None = Field(
        default=None,
        description="Why the replay stopped early, null when it did not: the broker or the "
        "database failed, or the job was triggered too often, after some letters were "
        "replayed (those in `replayed`). The letters it chose and did not replay are left in "
        "the queue, their run ids `not_reached` when asked for: ask again shortly for the "
        "rest. (Such a failure before any letter was replayed answers 503, or 429.)",
    )


class CronDropReport(_Out):
    run_id: str
    removed: int = Field(
        description="Letters removed: every copy of the run's letter the walk reached (or the "
        "letter with that message id)."
    )
    truncated: bool = Field(
        description=f"The walk stopped at its bound ({WALK_BOUND}) or its {WALK_BUDGET_S:.0f} "
        "s budget with letters left behind it: a copy past it, if any, is still there."
    )
    kept: int | None = Field(
        default=None,
        description=f"Only with `{CUT_OFF}`: letters of the run that were kept, not known to "
        "have been dead-lettered before it (of its second or later, or of unknown time).",
    )


CRON_DROP_PROBLEMS: dict[int | str, dict[str, Any]] = {
    404: problem(
        404,
        "No letter of that run, the walk having reached the end of the queue; nothing was "
        f"removed ({OUT_OF_SIGHT}; ask again to be sure).",
    ),
    409: problem(
        409,
        "No letter of that run among those the walk reached before its bound or its time "
        "budget (`not-reached`): it may lie past it. Nothing was removed.",
    ),
    **problem_responses(503),
}


def cron_dead_letter_routes(
    *, dead_letters: CronDeadLetters, admin_key: SecretStr | None
) -> APIRouter:
    router = APIRouter(
        prefix="/admin/v1/cron/dead-letters",
        tags=["cron"],
        dependencies=[admin_guard(admin_key)],
        responses={**ADMIN_PROBLEMS, **problem_responses(503)},
    )

    @router.get("", response_model=CronDeadLetterList)
    async def list_cron_dead_letters() -> CronDeadLetterList:
        with _broker_away_is_503():
            walk = await dead_letters.letters()
        items = [CronDeadLetterView(**asdict(letter)) for letter in walk.letters]
        return CronDeadLetterList(
            count=len(items), truncated=walk.truncated, listed_at=walk.listed_at, items=items
        )

    @router.post(
        "/replay",
        response_model=CronReplayReport,
        openapi_extra=json_body(CronReplayRequest),
        responses={
            **problem_responses(400, 413, 415, 422, 429),
            409: problem(
                409,
                "`unknown-job`: letters of jobs no longer configured, or that their settings "
                "leave unable to run, were named (`runs`); nothing was replayed and every "
                "letter is kept.",
            ),
            500: DATABASE_REFUSED_PROBLEM,
        },
    )
    async def replay_cron_dead_letters(request: Request) -> CronReplayReport:
        wanted = await read_model(
            request, CronReplayRequest, what="replay", limit=REPLAY_BODY_LIMIT
        )
        with _broker_away_is_503():
            try:
                replay = await dead_letters.replay(None if wanted.all else wanted.run_ids)
            except ReplayRefused as error:
                raise Problem(409, str(error), kind="unknown-job", runs=error.runs) from error
            except TriggeredTooOften as error:
                raise Problem(429, str(error), headers={"Retry-After": "1"}) from error
        return CronReplayReport(
            replayed=[
                ReplayedRun(
                    dead_run_id=letter.dead_run_id,
                    job=letter.job,
                    run_id=letter.run.run_id,
                    state=letter.run.state.value,
                    status_url=run_url(letter.run.run_id),
                    started_now=letter.started_now,
                )
                for letter in replay.replayed
            ],
            skipped_unreadable=replay.skipped_unreadable,
            skipped_unconfigured=replay.skipped_unconfigured,
            not_found=replay.not_found,
            skipped_in_progress=replay.skipped_in_progress,
            not_reached=replay.not_reached,
            truncated=replay.truncated,
            timed_out=replay.timed_out,
            interrupted=replay.interrupted,
        )

    @router.delete(
        "/{run_id}",
        response_model=CronDropReport,
        response_model_exclude_none=True,
        responses={**CRON_DROP_PROBLEMS, **problem_responses(422)},
    )
    async def drop_cron_dead_letter(
        run_id: str, cut_off: CutOffQuery, request: Request
    ) -> CronDropReport:
        await refuse_a_body(request, outcome="nothing was removed")
        with _broker_away_is_503():
            dropped = await dead_letters.drop(run_id, cut_off=cut_off)
        if not dropped.removed and not dropped.kept:
            raise nothing_dropped(
                f"No dead letter of cron run {quoted(run_id)}", dropped, out_of_sight=OUT_OF_SIGHT
            )
        return CronDropReport(
            run_id=run_id,
            removed=dropped.removed,
            truncated=dropped.truncated,
            kept=None if cut_off is None else dropped.kept,
        )

    @router.delete(
        "",
        response_model=PurgeReport,
        response_model_exclude_none=True,
        responses=problem_responses(422),
    )
    async def purge_cron_dead_letters(cut_off: CutOffQuery, request: Request) -> PurgeReport:
        await refuse_a_body(request, outcome="nothing was removed")
        with _broker_away_is_503():
            return await purge_report(dead_letters, cut_off)

    return router


@contextlib.contextmanager
def _broker_away_is_503() -> Iterator[None]:
    """The broker away, blocked or refusing a run: a 503 to retry. A replay raises it only
    before it replayed any letter (a failure after that ends it with what it did,
    `interrupted`); asked again, it does not run a replayed run twice."""
    try:
        yield
    except (*BROKER_ERRORS, DispatchFailed) as error:
        detail = "The message broker is unavailable; try again shortly."
        if isinstance(error, DispatchFailed):
            detail = f"{error}; try again shortly."
        raise Problem(503, detail, kind="broker-unavailable", headers=RETRY_AFTER_BROKER) from error


def usage_range(first: str, last: str) -> tuple[date, date]:
    """The inclusive day range of a usage query; raises a 422 `Problem` when it is unusable."""
    first_day, last_day = parse_day(first, "from"), parse_day(last, "to")
    if last_day < first_day:
        raise invalid_query("to", "must not be before `from`")
    if last_day - first_day >= timedelta(days=MAX_USAGE_RANGE_DAYS):
        raise invalid_query("to", f"a usage query spans at most {MAX_USAGE_RANGE_DAYS} days")
    return first_day, last_day


def _totals(rows: list[DailyUsage]) -> UsageTotals:
    requests = sum(row.requests for row in rows)
    return UsageTotals(
        requests=requests,
        prompt_tokens=sum(row.prompt_tokens for row in rows),
        completion_tokens=sum(row.completion_tokens for row in rows),
        total_tokens=sum(row.total_tokens for row in rows),
        cost=usage_cost(
            sum(row.cost_nanos for row in rows),
            requests=requests,
            priced=sum(row.priced_requests for row in rows),
        ),
        unpriced_requests=sum(row.unpriced_requests for row in rows),
    )


def usage_routes(
    *, daily: DailyUsageStore, currency: str, internal_key: SecretStr | None
) -> APIRouter:
    """The gateway's reads of daily usage, guarded by `INTERNAL_API_KEY` when it is set."""
    router = APIRouter(
        prefix="/internal/v1",
        tags=["usage"],
        dependencies=[internal_guard(internal_key)],
        responses={**INTERNAL_PROBLEMS, **problem_responses(503)},
    )

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
