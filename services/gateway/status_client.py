"""Reads of the status service, over HTTP (the gateway never reads its database).

Anything but a readable answer — the service unreachable, an answer that is not HTTP (see
`shared.aiohttp_transport`), a status other than 200 or the service's own 404, a body that
is not the service's — is `StatusUnavailable` (503, retry shortly), never a 500; but the
service's own 500 `database-refused` (its database refuses the read for good) is
`StatusRefused`, answered as that 500, without Retry-After.

Only the status service's "task unknown" problem (`TASK_UNKNOWN`) means unknown: any 404
counted, and a proxy's page during a redeploy or a `STATUS_URL` with a wrong path made the
gateway answer 404 "no such task" for every task past its read-your-writes window, which
clients take for lost and submit again (found in review).
"""

from __future__ import annotations

import logging

import httpx
from pydantic import BaseModel, ValidationError

from services.gateway.errors import StatusRefused, StatusUnavailable
from shared.contracts import BatchProgress, TaskHistory, TaskView
from shared.http import (
    PROBLEM_BASE,
    TASK_UNKNOWN,
    database_refused_answer,
    log_if_internal_key_refused,
    problem_in,
    unreadable,
)
from shared.log_rate import FailedCalls

log = logging.getLogger("scorebox.gateway")


class StatusClient:
    def __init__(self, http: httpx.AsyncClient, *, base_url: str) -> None:
        self._http = http
        self._base_url = base_url.rstrip("/")
        self._failed = FailedCalls("status service", log)

    async def find(self, task_id: str, *, tenant_id: str) -> TaskView | None:
        return await self._get(TaskView, f"/internal/v1/tasks/{task_id}", {"tenant_id": tenant_id})

    async def history(self, task_id: str, *, tenant_id: str, after: int) -> TaskHistory | None:
        """The task's state changes after sequence `after`; None when unknown or expired."""
        return await self._get(
            TaskHistory,
            f"/internal/v1/tasks/{task_id}/history",
            {"tenant_id": tenant_id, "after": after},
        )

    async def batch(
        self, batch_id: str, *, tenant_id: str, after: int, limit: int
    ) -> BatchProgress:
        """Counts and a page (by `batch_index` after `after`) of the tasks the status knows."""
        progress = await self._get(
            BatchProgress,
            f"/internal/v1/batches/{batch_id}",
            {"tenant_id": tenant_id, "after": after, "limit": limit},
        )
        return BatchProgress(batch_id=batch_id) if progress is None else progress

    async def _get[Model: BaseModel](
        self, model: type[Model], path: str, params: dict[str, str | int]
    ) -> Model | None:
        """The answer as `model`; None for the service's own "task unknown". Every failure
        is noted for the log (`FailedCalls`) as it is raised."""
        try:
            response = await self._answered(path, params)
            return None if response is None else _read(model, response)
        except StatusUnavailable as error:
            self._failed.note(error)
            raise

    async def _answered(self, path: str, params: dict[str, str | int]) -> httpx.Response | None:
        try:
            response = await self._http.get(f"{self._base_url}{path}", params=params)
        except httpx.HTTPError as error:
            raise StatusUnavailable(f"status service unreachable: {error!r}") from error
        if response.status_code == 404 and _says_task_unknown(response):
            return None
        if database_refused_answer(response):
            raise StatusRefused("the status service's database refused the read for good")
        if response.status_code != 200:
            log_if_internal_key_refused(response.status_code, "status service")
            raise StatusUnavailable(f"status service answered {response.status_code}")
        return response


def _read[Model: BaseModel](model: type[Model], response: httpx.Response) -> Model:
    """The answer as `model`: a body that is not one (a proxy's page, another version's
    schema) is the status service unavailable, as an unreachable one is."""
    try:
        return model.model_validate_json(response.content)
    except ValidationError as error:
        raise StatusUnavailable(
            f"status service answered an unreadable body: {unreadable(error)}"
        ) from error


# What status services before `TASK_UNKNOWN` answered for an unknown task (a rolling upgrade).
_EARLIER_TASK_UNKNOWN = (PROBLEM_BASE + "not-found", "No task ")


def _says_task_unknown(response: httpx.Response) -> bool:
    """Whether a 404 is the status service's own "task unknown" problem+json."""
    problem = problem_in(response) or {}
    kind, detail = problem.get("type"), problem.get("detail")
    if kind == PROBLEM_BASE + TASK_UNKNOWN:
        return True
    earlier_kind, earlier_detail = _EARLIER_TASK_UNKNOWN
    return kind == earlier_kind and isinstance(detail, str) and detail.startswith(earlier_detail)
