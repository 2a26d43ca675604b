"""Reads of the scheduler's usage read model, over HTTP (the gateway never reads its database).

`GET /internal/v1/usage?tenant_id=&from=&to=` answers a tenant's daily usage; the models
below are the gateway's own (tolerant) reading of it, and what `GET /v1/usage` answers.
"""

from __future__ import annotations

import logging

import httpx
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.errors import GatewayError, Unavailable
from services.gateway.settings import GatewaySettings
from shared.aiohttp_transport import MappedAiohttpTransport
from shared.http import database_refused_answer, log_if_internal_key_refused, unreadable
from shared.log_rate import FailedCalls

log = logging.getLogger("scorebox.gateway")

MAX_CONNECTIONS = 32


class SchedulerUnavailable(Unavailable):
    """The scheduler did not answer (or answered something unexpected)."""

    what = "The scheduler"


class SchedulerRefused(SchedulerUnavailable):
    """The scheduler answered that its database refuses the read for good."""

    for_good = True


class UsageQueryRejected(GatewayError):
    """The scheduler refused the query (422): a malformed date or an unusable range. `errors`:
    the fields it named (`field`, `message`), passed on to the client."""

    def __init__(self, detail: str, errors: list[dict[str, str]]) -> None:
        super().__init__(detail)
        self.detail = detail
        self.errors = errors

    def naming(self, field: str, instead: str) -> UsageQueryRejected:
        """The refusal with `field` named `instead` (the gateway's own name for it)."""
        return UsageQueryRejected(
            self.detail.replace(f"{field}:", f"{instead}:"),
            [
                error | {"field": instead} if error["field"] == field else error
                for error in self.errors
            ],
        )


class _Model(BaseModel):
    model_config = ConfigDict(frozen=True, extra="ignore", populate_by_name=True)


class DailyUsage(_Model):
    """One UTC day of a tenant's completed tasks."""

    date: str = Field(description="The UTC day, YYYY-MM-DD.", examples=["2025-01-31"])
    requests: int = Field(
        ge=0,
        description="Completed tasks (re-scores count again), and failed ones whose model "
        "calls used tokens (an unusable answer, a retry's billed call before a give-up or a "
        "cancellation).",
    )
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    cost: float | None = Field(
        description="Of the priced requests; None when the day's requests had no price."
    )
    unpriced_requests: int = Field(ge=0, description="Requests whose model has no price.")


class UsageTotals(_Model):
    """The sums over the period."""

    requests: int = Field(ge=0)
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    total_tokens: int = Field(ge=0)
    cost: float | None = Field(
        description="Of the priced requests; None when the period's requests had no price, "
        "0 when it had none."
    )
    unpriced_requests: int = Field(ge=0)


class UsageReport(_Model):
    """A tenant's usage per UTC day over a period (both ends included)."""

    tenant_id: str
    from_: str = Field(alias="from", description="First day, YYYY-MM-DD.")
    to: str = Field(description="Last day, YYYY-MM-DD.")
    currency: str = Field(examples=["USD"])
    days: list[DailyUsage] = Field(description="Days with usage only, ascending.")
    totals: UsageTotals


def make_scheduler_http(settings: GatewaySettings) -> httpx.AsyncClient:
    limits = httpx.Limits(
        max_connections=MAX_CONNECTIONS, max_keepalive_connections=MAX_CONNECTIONS
    )
    return httpx.AsyncClient(
        transport=MappedAiohttpTransport(
            limits=limits, total_timeout_s=settings.scheduler_timeout_s
        ),
        timeout=httpx.Timeout(settings.scheduler_timeout_s),
        limits=limits,
    )


def _rejection(response: httpx.Response) -> UsageQueryRejected:
    """The scheduler's 422 as the gateway passes it on: its detail, and the fields it named
    (a 422 without `errors` answered the client unlike every other one; a walkthrough)."""
    try:
        problem = response.json()
    except ValueError:
        problem = None
    if not isinstance(problem, dict):
        problem = {}
    detail = problem.get("detail")
    if not isinstance(detail, str):
        detail = "The usage query is not valid."
    errors = [
        {"field": error["field"], "message": error["message"]}
        for error in problem.get("errors") or []
        if isinstance(error, dict)
        and isinstance(error.get("field"), str)
        and isinstance(error.get("message"), str)
    ]
    return UsageQueryRejected(detail, errors or [{"field": "query", "message": detail}])


class SchedulerClient:
    def __init__(self, http: httpx.AsyncClient, *, base_url: str) -> None:
        self._http = http
        self._base_url = base_url.rstrip("/")
        self._failed = FailedCalls("scheduler", log)

    async def usage(self, tenant_id: str, *, first_day: str, last_day: str) -> UsageReport:
        """The tenant's daily usage from `first_day` to `last_day` (YYYY-MM-DD, inclusive);
        every failure noted for the log (`FailedCalls`) as it is raised."""
        try:
            return await self._usage(tenant_id, first_day=first_day, last_day=last_day)
        except SchedulerUnavailable as error:
            self._failed.note(error)
            raise

    async def _usage(self, tenant_id: str, *, first_day: str, last_day: str) -> UsageReport:
        try:
            response = await self._http.get(
                f"{self._base_url}/internal/v1/usage",
                params={"tenant_id": tenant_id, "from": first_day, "to": last_day},
            )
        # `InvalidURL` is no `HTTPError`: a URL httpx cannot build (over its length limit, once
        # a 500) is not sent; the gateway checks what it puts in it, so it is left to
        # `SCHEDULER_URL`.
        except (httpx.HTTPError, httpx.InvalidURL) as error:
            raise SchedulerUnavailable(f"scheduler unreachable: {error!r}") from error
        if response.status_code == 422:
            raise _rejection(response)
        if database_refused_answer(response):
            raise SchedulerRefused("the scheduler's database refused the read for good")
        if response.status_code != 200:
            log_if_internal_key_refused(response.status_code, "scheduler")
            raise SchedulerUnavailable(f"scheduler answered {response.status_code}")
        try:
            return UsageReport.model_validate_json(response.content)
        except ValidationError as error:
            raise SchedulerUnavailable(
                f"scheduler answered an unreadable report: {unreadable(error)}"
            ) from error
