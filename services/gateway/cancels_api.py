"""`POST /v1/scores/{task_id}/cancel` and `POST /v1/batches/{batch_id}/cancel`: the HTTP
adapters of `services/gateway/cancels.py`."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Protocol

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from services.gateway.api import LOCATION_HEADER, TASK_ID, GatewayDeps, _unavailable, status_url
from services.gateway.auth import Caller
from services.gateway.batches import Batches
from services.gateway.batches_api import BATCH_ID, batch_url, unknown_batch
from services.gateway.cancels import (
    BatchBeingRecorded,
    BatchCancelSender,
    CancelRefused,
    CancelSender,
    TaskBeingAccepted,
    cancel_batch,
    cancel_task,
)
from services.gateway.errors import BrokerUnavailable, Unavailable
from services.gateway.schemas import BatchCancelRequested, CancelRequested
from shared.bodies import refuse_a_body
from shared.http import Problem, problem, problem_responses, quoted

UNAVAILABLE = "The database or the broker is unavailable."
# The broker did not confirm the cancel's publish: it may be queued all the same.
UNCONFIRMED = "The cancellation may or may not have been queued; send it again."
# Not every cancellation of a batch was confirmed: some may be queued, and a repeat is harmless.
BATCH_UNCONFIRMED = (
    "Some of the batch's cancellations may have been queued, not all were confirmed; send it "
    "again (each task's cancellation is recorded once)."
)


# The problem type of a batch cancel refused while the batch's items are being recorded.
BATCH_BEING_ACCEPTED = "batch-being-accepted"
TASK_BEING_ACCEPTED = "task-being-accepted"


def _ask_again_later(error: TaskBeingAccepted | BatchBeingRecorded, kind: str) -> Problem:
    """409 `kind`: its request may still be recording or sending it; nothing was cancelled."""
    return Problem(409, str(error), kind=kind, headers={"Retry-After": str(error.retry_after_s)})


class Canceller(CancelSender, BatchCancelSender, Protocol):
    """Sends one cancellation or a batch's (`services.gateway.publisher.TaskPublisher`)."""


def cancel_routes(
    deps: GatewayDeps, sender: Canceller, authenticated: Any, *, batches: Batches
) -> APIRouter:
    router = APIRouter(prefix="/v1")

    @router.post(
        "/scores/{task_id}/cancel",
        status_code=202,
        tags=["scores"],
        response_model=CancelRequested,
        summary="Cancel a task whose model call has not started",
        description="The task then fails with `error.code` `cancelled` (its callback and "
        "usage as for any failure), unless its model call had started by the time a scorer takes "
        "the cancellation (it travels apart from the task's own command, so a busy scorer may "
        "start the call first): it then ends as that call decides. A re-score of a completed "
        "task is not cancelled (409: the completion stands). A repeat before the task's "
        "outcome is applied is answered 202 again (the cancellation is recorded once); after "
        "it, 409. Poll the `status_url` for the outcome.",
        responses={
            202: {"headers": LOCATION_HEADER},
            **problem_responses(401, 404, 409, 429, 503),
            409: problem(
                409,
                "The task has finished (completed or failed); or, "
                f"`{TASK_BEING_ACCEPTED}`, its request (a batch's, listed from its start) is "
                "still recording and sending it: nothing was cancelled, ask again after "
                "Retry-After.",
                retry_after=True,
            ),
            503: problem(503, f"{UNAVAILABLE} {UNCONFIRMED}"),
        },
    )
    async def cancel(
        task_id: str, request: Request, caller: Caller = authenticated
    ) -> JSONResponse:
        await refuse_a_body(request, outcome="nothing was cancelled")
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
                grace=timedelta(seconds=deps.settings.outbox_grace_s),
            )
        except TaskBeingAccepted as error:
            raise _ask_again_later(error, TASK_BEING_ACCEPTED) from error
        except BrokerUnavailable as error:
            raise _unconfirmed(error) from error
        except Unavailable as error:
            raise _unavailable(error) from error
        if sent is CancelRefused.UNKNOWN_TASK:
            raise _unknown(task_id)
        if sent is CancelRefused.ALREADY_FINISHED:
            raise Problem(
                409, f"Task {quoted(task_id)} has already finished.", kind="already-finished"
            )
        body = CancelRequested(task_id=task_id, status_url=status_url(task_id))
        return JSONResponse(
            body.model_dump(), status_code=202, headers={"Location": status_url(task_id)}
        )

    @router.post(
        "/batches/{batch_id}/cancel",
        status_code=202,
        response_model=BatchCancelRequested,
        tags=["batches"],
        summary="Cancel every item of a batch whose model call has not started",
        description="Each item the gateway does not know to be finished is sent a "
        "cancellation, as `POST /v1/scores/{task_id}/cancel` would: it then fails with "
        "`error.code` `cancelled` unless its model call had started. `cancelling` counts the "
        "items sent one, `already_finished` those left as they are (their outcome applied, or "
        "answered from the result cache); an item finishing meanwhile ends as it did. A repeat "
        "is answered 202 again (each task's cancellation is recorded once). Poll the "
        "`status_url` for the items' outcomes.",
        responses={
            202: {"headers": LOCATION_HEADER},
            **problem_responses(401, 404, 429, 503),
            409: problem(
                409,
                f"`{BATCH_BEING_ACCEPTED}`: the batch's request (or its replay) is still "
                "recording or sending its items; nothing was cancelled. Ask again after "
                "Retry-After.",
                retry_after=True,
            ),
            503: problem(503, f"{UNAVAILABLE} {BATCH_UNCONFIRMED}"),
        },
    )
    async def cancel_a_batch(
        batch_id: str, request: Request, caller: Caller = authenticated
    ) -> JSONResponse:
        await refuse_a_body(request, outcome="nothing was cancelled")
        if not BATCH_ID.match(batch_id):
            raise unknown_batch(batch_id)
        try:
            cancelled = await cancel_batch(
                batch_id,
                tenant_id=caller.tenant_id,
                batches=batches,
                submissions=deps.submissions,
                sender=sender,
                now=deps.clock(),
                grace=timedelta(seconds=deps.settings.outbox_grace_s),
            )
        except BatchBeingRecorded as error:
            raise _ask_again_later(error, BATCH_BEING_ACCEPTED) from error
        except BrokerUnavailable as error:
            raise _unconfirmed(error, BATCH_UNCONFIRMED) from error
        except Unavailable as error:
            raise _unavailable(error) from error
        if cancelled is None:
            raise unknown_batch(batch_id)
        body = BatchCancelRequested(
            batch_id=batch_id,
            cancelling=len(cancelled.sent),
            already_finished=cancelled.already_finished,
            status_url=batch_url(batch_id),
        )
        return JSONResponse(
            body.model_dump(), status_code=202, headers={"Location": batch_url(batch_id)}
        )

    return router


def _unconfirmed(error: BrokerUnavailable, unconfirmed: str = UNCONFIRMED) -> Problem:
    """The cancel's publish was not confirmed (or not sent): it may be queued all the same, so
    the 503 of `_unavailable` ("nothing was kept") would mislead. Sending it again is harmless:
    the scorer records a cancellation once."""
    return Problem(
        503,
        f"{error.away}. {unconfirmed}",
        kind="unavailable",
        headers={"Retry-After": str(error.retry_after_s)},
    )


def _unknown(task_id: str) -> Problem:
    return Problem(404, f"No task {quoted(task_id)} is known (or it has expired).")
