"""`GET /v1/usage`: the caller's tenant's daily usage, kept by the scheduler.

The gateway authenticates the caller and forwards to the scheduler's internal usage route for
the caller's tenant (`SchedulerClient`); a refused query (422) is answered with the
scheduler's reason, an unreachable scheduler with 503 and Retry-After.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, date, datetime, timedelta
from typing import Annotated, Any, Final

from fastapi import APIRouter, Query

from services.gateway.auth import Caller
from services.gateway.errors import refused_for_good
from services.gateway.scheduler_client import (
    SchedulerClient,
    SchedulerUnavailable,
    UsageQueryRejected,
    UsageReport,
)
from shared.http import (
    DATABASE_REFUSED_PROBLEM,
    Problem,
    database_refused,
    invalid_query,
    parse_day,
    problem_responses,
)

Clock = Callable[[], datetime]
DEFAULT_PERIOD_DAYS: Final = 30

_EXAMPLE = {
    "tenant_id": "acme",
    "from": "2025-01-01",
    "to": "2025-01-31",
    "currency": "USD",
    "days": [
        {
            "date": "2025-01-02",
            "requests": 3,
            "prompt_tokens": 3500,
            "completion_tokens": 350,
            "total_tokens": 3850,
            "cost": 0.0042,
            "unpriced_requests": 0,
        }
    ],
    "totals": {
        "requests": 3,
        "prompt_tokens": 3500,
        "completion_tokens": 350,
        "total_tokens": 3850,
        "cost": 0.0042,
        "unpriced_requests": 0,
    },
}


def usage_period(first_day: str | None, last_day: str | None, *, today: date) -> tuple[str, str]:
    """The period to ask for: `to` defaults to today (UTC), `from` to 30 days before `to`.

    Given dates must be YYYY-MM-DD (422 otherwise): unchecked, any text was sent on in the
    scheduler's query string, and one too long for a URL was a 500. The scheduler checks the
    range.
    """
    first_given, last = _given_days(first_day, last_day, today=today)
    if first_given is not None:
        if last_day is None and first_given > last:
            # The scheduler's refusal named `to`, which the client had not sent (found in a
            # walkthrough).
            raise invalid_query(
                "from", f"must not be after today ({last.isoformat()}), where `to` defaults to"
            )
        return first_given.isoformat(), last.isoformat()
    try:
        first = last - timedelta(days=DEFAULT_PERIOD_DAYS)
    except OverflowError:
        raise invalid_query("to", f"`to` is too early: {last.isoformat()!r}") from None
    return first.isoformat(), last.isoformat()


def _given_days(
    first_day: str | None, last_day: str | None, *, today: date
) -> tuple[date | None, date]:
    """`from` (None when not given) and `to` (today when not given) as dates; one 422 naming
    every malformed one (it named the first only)."""
    parsed: dict[str, date] = {}
    refused: list[Problem] = []
    for name, value in (("from", first_day), ("to", last_day)):
        if value is None:
            continue
        try:
            parsed[name] = parse_day(value, name)
        except Problem as problem:
            refused.append(problem)
    if refused:
        raise Problem(
            422,
            " ".join(problem.detail for problem in refused),
            kind="invalid-fields",
            errors=[error for problem in refused for error in problem.extensions["errors"]],
        )
    return parsed.get("from"), parsed.get("to", today)


def usage_routes(scheduler: SchedulerClient, authenticated: Any, *, clock: Clock) -> APIRouter:
    """The tenant's usage route; `authenticated` is the dependency that yields a `Caller`."""
    router = APIRouter(prefix="/v1", tags=["usage"])

    @router.get(
        "/usage",
        response_model=UsageReport,
        summary="Your daily usage: completed tasks, tokens and cost",
        description="Per UTC day with usage, and in total, over `from`..`to` (both included; at "
        "most 366 days). `to` defaults to today (UTC), `from` to 30 days before `to`. Usage is "
        "rolled up periodically (hourly by default), so the latest tasks may not be counted "
        "yet. A re-scored task counts again. `cost` is null when there were requests and none "
        "had a priced model (0 when there were none). "
        "Any other query parameter, or one given twice, is refused (422).",
        responses={
            200: {"content": {"application/json": {"example": _EXAMPLE}}},
            **problem_responses(401, 422, 429, 503),
            500: DATABASE_REFUSED_PROBLEM,
        },
    )
    async def read_usage(
        caller: Caller = authenticated,
        first_day: Annotated[
            str | None,
            Query(alias="from", description="First UTC day, YYYY-MM-DD.", examples=["2025-01-01"]),
        ] = None,
        last_day: Annotated[
            str | None,
            Query(alias="to", description="Last UTC day, YYYY-MM-DD.", examples=["2025-01-31"]),
        ] = None,
    ) -> UsageReport:
        first, last = usage_period(first_day, last_day, today=clock().astimezone(UTC).date())
        try:
            return await scheduler.usage(caller.tenant_id, first_day=first, last_day=last)
        except UsageQueryRejected as error:
            # `to` not sent: a range the scheduler refused (naming `to`) is one `from` made.
            refused = error if last_day is not None else error.naming("query.to", "query.from")
            raise Problem(
                422, refused.detail, kind="invalid-fields", errors=refused.errors
            ) from error
        except SchedulerUnavailable as error:
            if refused_for_good(error):
                raise database_refused(error) from error
            raise Problem(
                503,
                "Usage is unavailable right now; retry shortly.",
                kind="unavailable",
                headers={"Retry-After": str(error.retry_after_s)},
            ) from error

    return router
