"""`POST /v1/scores/{task_id}/cancel`: the HTTP adapter of `services/gateway/cancels.py`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from fastapi.responses import JSONResponse

from services.gateway.api import LOCATION_HEADER, TASK_ID, GatewayDeps, _unavailable, status_url
from services.gateway.auth import Caller
from services.gateway.cancels import CancelRefused, CancelSender, cancel_task
from services.gateway.errors import BrokerUnavailable, Unavailable
from services.gateway.schemas import CancelRequested
from shared.http import Problem, problem, problem_responses

UNAVAILABLE = "The database or the broker is unavailable."
# The broker did not confirm the cancel's publish: it may be queued all the same.
UNCONFIRMED = "The cancellation may or may not have been queued; send it again."


def cancel_routes(deps: GatewayDeps, sender: CancelSender, authenticated: Any) -> APIRouter:
    router = APIRouter(prefix="/v1", tags=["scores"])

    @router.post(
        "/scores/{task_id}/cancel",
        status_code=202,
        response_model=CancelRequested,
        summary="Cancel a task whose model call has not started",
        description="The task then fails with `error.code` `cancelled` (its callback and "
        "usage as for any failure), unless its model call had started: it then ends as that "
        "call decides. A repeat before the task's outcome is applied is answered 202 again "
        "(the cancellation is recorded once); after it, 409. Poll the `status_url` for the "
        "outcome.",
        responses={
            202: {"headers": LOCATION_HEADER},
            **problem_responses(401, 404, 409, 429, 503),
            409: problem(409, "The task has finished (completed or failed)."),
            503: problem(503, f"{UNAVAILABLE} {UNCONFIRMED}"),
        },
    )
    async def cancel(task_id: str, caller: Caller = authenticated) -> JSONResponse:
        if not TASK_ID.match(task_id):
            raise _unknown(task_id)
        try:
            sent = await cancel_task(
                task_id,
                tenant_id=caller.tenant_id,
                submissions=deps.submissions,
                status=deps.status,
                sender=sender,
                now=deps.clock(),
            )
        except BrokerUnavailable as error:
            raise _unconfirmed(error) from error
        except Unavailable as error:
            raise _unavailable(error) from error
        if sent is CancelRefused.UNKNOWN_TASK:
            raise _unknown(task_id)
        if sent is CancelRefused.ALREADY_FINISHED:
            raise Problem(409, f"Task {task_id!r} has already finished.", kind="already-finished")
        body = CancelRequested(task_id=task_id, status_url=status_url(task_id))
        return JSONResponse(
            body.model_dump(), status_code=202, headers={"Location": status_url(task_id)}
        )

    return router


def _unconfirmed(error: BrokerUnavailable) -> Problem:
    """The cancel's publish was not confirmed (or not sent): it may be queued all the same, so
    the 503 of `_unavailable` ("nothing was kept") would mislead. Sending it again is harmless:
    the scorer records a cancellation once."""
    return Problem(
        503,
        f"{type(error).__name__}: {UNCONFIRMED}",
        kind="unavailable",
        headers={"Retry-After": str(error.retry_after_s)},
    )


def _unknown(task_id: str) -> Problem:
    return Problem(404, f"No task {task_id!r} is known (or it has expired).")
