"""The public HTTP API: a thin adapter from HTTP to the gateway's handlers.

Bodies are read by hand (not by FastAPI's validation) so that each kind of bad input gets its
own clear answer: 415 wrong content type, 413 too large (checked before the body is read
whole), 400 not JSON, 422 invalid fields.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Annotated, Any

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError

from services.gateway import admission, schemas
from services.gateway.auth import Caller, Callers, key_ended_while_waiting
from services.gateway.cache import ResultCache
from services.gateway.errors import (
    IDEMPOTENCY_KEY,
    IdempotencyConflict,
    ReplayUnfinished,
    RequestInProgress,
    Unavailable,
    nothing_kept,
    refused_for_good,
)
from services.gateway.limits import InFlight, LimitExceeded, limit_problem
from services.gateway.push import LiveUpdates, WaiterLimitReached, read_when_changed
from services.gateway.refusals import Refusals
from services.gateway.schemas import (
    ALLOWED_MODELS_CONTEXT,
    EXPIRED,
    NOW_CONTEXT,
    ScoreSubmission,
    SubmissionAccepted,
)
from services.gateway.settings import GatewaySettings
from services.gateway.submissions import Submissions
from services.gateway.submit import (
    Publisher,
    StatusReader,
    SubmitPolicy,
    Submitted,
    described_by,
    read_score,
    submit_score,
)
from shared.bodies import (
    dotted_field,
    invalid_fields,
    read_json_object,
    refuse_many_unknown_fields,
    unknown_fields,
)
from shared.contracts import CACHED_COMPLETION_SEQUENCE, TaskStatus, TaskView, to_millis
from shared.http import (
    DATABASE_REFUSED_PROBLEM,
    Problem,
    database_refused,
    problem,
    problem_responses,
    quoted,
)

# `\Z`, not `$`: `$` also matches before a trailing newline.
log = logging.getLogger("scorebox.gateway")
TASK_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
# The query parameters of `GET /v1/scores/{task_id}`.

LOCATION_HEADER = {
    "Location": {
        "description": "Where to poll: the `status_url` of the body.",
        "schema": {"type": "string"},
    }
}


@dataclass(frozen=True)
class GatewayDeps:
    settings: GatewaySettings
    submissions: Submissions
    cache: ResultCache
    publisher: Publisher
    status: StatusReader
    clock: Callable[[], datetime]
    in_flight: InFlight
    live: LiveUpdates = field(default_factory=LiveUpdates)
    refusals: Refusals = field(default_factory=Refusals)


def submission_responses(replayed: dict[str, Any]) -> dict[int | str, dict[str, Any]]:
    """The `responses` of a submission route: its 202 and `replayed` (its 200) with their
    `Location`, and its problems (a write the database refuses for good included)."""
    in_progress = problem(
        409,
        "The Idempotency-Key was used with another body, or its first request is still being "
        "accepted (`request-in-progress`, with `Retry-After`).",
        retry_after=True,
    )
    return {
        202: {"headers": LOCATION_HEADER},
        200: {**replayed, "headers": LOCATION_HEADER},
        **problem_responses(400, 401, 408, 409, 413, 415, 422, 429, 503),
        409: in_progress,
        500: DATABASE_REFUSED_PROBLEM,
    }


def status_url(task_id: str) -> str:
    return f"/v1/scores/{task_id}"


async def parse_submission(
    request: Request,
    settings: GatewaySettings,
    clock: Callable[[], datetime],
    *,
    arrived: Callable[[], Awaitable[None]] | None = None,
) -> ScoreSubmission:
    payload = await read_json_object(
        request, what="submission", limit=settings.max_body_bytes, arrived=arrived
    )
    refuse_many_unknown_fields(unknown_fields(payload, ScoreSubmission), dotted_field)
    text = payload.get("text")
    if isinstance(text, str) and len(text) > settings.max_text_chars:
        raise Problem(
            413,
            f"The text has {len(text)} characters; the limit is {settings.max_text_chars}.",
            kind="text-too-long",
        )
    try:
        return ScoreSubmission.model_validate(
            payload,
            context={ALLOWED_MODELS_CONTEXT: settings.allowed_models, NOW_CONTEXT: clock()},
        )
    except ValidationError as error:
        raise invalid_fields(error) from error


def _check_idempotency_key(key: str | None, request: Request) -> str | None:
    """The request's one Idempotency-Key. Sent twice, the first was taken and the second
    ignored: a retry carrying only the second was a new task, scored again."""
    if len(request.headers.getlist("idempotency-key")) > 1:
        raise Problem(400, "Idempotency-Key was sent more than once: send one.")
    if key is not None and not IDEMPOTENCY_KEY.match(key):
        raise Problem(400, "Idempotency-Key must be 1 to 255 visible ASCII characters.")
    return key


def _unavailable(error: Unavailable, *, idempotency_key: str | None = None) -> Problem:
    """503: nothing of this request was kept. A submission's replay (`idempotency_key`) is
    told that what its key's first request started goes on: "nothing was kept" told a client
    whose first request was accepted that it was lost (a review)."""
    if refused_for_good(error):
        return database_refused(error)
    return Problem(
        503,
        f"{error.away}; {nothing_kept(idempotency_key)}",
        kind="unavailable",
        headers={"Retry-After": str(error.retry_after_s)},
    )


def read_unavailable(error: Unavailable) -> Problem:
    """503 for a read: "nothing was kept" (a submission's wording) told a client polling an
    accepted task that it was lost, and one resubmitting had its text scored twice."""
    if refused_for_good(error):
        return database_refused(error)
    return Problem(
        503,
        f"{error.away}, so this cannot be read right now; nothing was changed (an accepted "
        "task is still being scored). Retry shortly.",
        kind="unavailable",
        headers={"Retry-After": str(error.retry_after_s)},
    )


def in_progress_problem(error: RequestInProgress, *, unfinished: str, pending: str) -> Problem:
    """409 `request-in-progress`: the key's first request is being accepted (`pending`), or
    was received and the database failed the replay (`ReplayUnfinished`, `unfinished`: not a
    503, which says nothing was kept, and a client resubmitting without the key had its
    text scored twice)."""
    detail = unfinished if isinstance(error, ReplayUnfinished) else pending
    return Problem(
        409,
        detail,
        kind="request-in-progress",
        headers={"Retry-After": str(error.retry_after_s)},
    )


def waiter_problem(error: WaiterLimitReached) -> Problem:
    """Over the caller's share of long-polls and streams: 429; over the replica's: 503."""
    headers = {"Retry-After": str(error.retry_after_s)}
    if error.per_tenant:
        return Problem(
            429,
            "Too many open event streams and long-polls for this tenant; close some first.",
            kind="too-many-waiters",
            headers=headers,
        )
    return Problem(
        503,
        "This server has too many open event streams and long-polls; retry shortly.",
        kind="unavailable",
        headers=headers,
    )


def _view_json(view: TaskView, headers: dict[str, str] | None = None) -> JSONResponse:
    body = {**view.model_dump(mode="json"), "status_url": status_url(view.task_id)}
    return JSONResponse(body, status_code=200, headers=headers)


def _cached_view(submitted: Submitted, now: datetime) -> TaskView:
    """A task answered from the result cache, as its status URL shows it once recorded: its
    completion dated when it was submitted, at the database's precision, with the cached
    completion's sequence (the POST said the moment of its answer, to the microsecond, and
    no sequence: found in a walkthrough)."""
    at = to_millis(submitted.submitted_at or now)
    return TaskView(
        task_id=submitted.task_id,
        status=submitted.status,
        attempts=0,
        created_at=at,
        updated_at=at,
        result=submitted.cached_result,
        sequence=CACHED_COMPLETION_SEQUENCE,
        **described_by(submitted.command),
    )


def score_routes(
    deps: GatewayDeps, callers: Callers, still_valid: Callable[[Caller], Awaitable[bool]]
) -> APIRouter:
    """The public score routes; `callers` the dependencies that yield a `Caller`, `still_valid`
    tells whether its key is still active when a long-poll ends."""
    router = APIRouter(prefix="/v1", tags=["scores"])
    authenticated = callers.authenticated
    policy = SubmitPolicy(
        max_attempts=deps.settings.max_attempts,
        retention=timedelta(seconds=deps.settings.idempotency_ttl_s),
        default_model=deps.settings.default_model,
        in_progress_for=timedelta(seconds=deps.settings.outbox_grace_s),
    )

    @router.post(
        "/scores",
        status_code=202,
        response_model=SubmissionAccepted,
        summary="Submit a text for scoring",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": ScoreSubmission.model_json_schema()}},
            }
        },
        responses=submission_responses(
            {
                "description": "The same Idempotency-Key and body: the earlier task, as a poll "
                "answers it (or, while the status service cannot tell, as accepted); or a "
                "result-cache hit: a task completed at once (`result.cached` is true).",
                "model": schemas.TaskView | SubmissionAccepted,
            }
        ),
    )
    async def submit(
        request: Request,
        idempotency_key: str | None = Header(default=None, alias="Idempotency-Key"),
        caller: Caller = callers.identified,
    ) -> JSONResponse:
        submission = await callers.read_counted(
            caller, parse_submission, request, deps.settings, deps.clock
        )
        try:
            submitted = await submit_score(
                submission,
                tenant_id=caller.tenant_id,
                idempotency_key=_check_idempotency_key(idempotency_key, request),
                submissions=deps.submissions,
                publisher=deps.publisher,
                cache=deps.cache,
                policy=policy,
                clock=deps.clock,
                refusals=deps.refusals,
                api_key_id=caller.key_id,
                in_flight=deps.in_flight,
            )
        except LimitExceeded as error:
            raise limit_problem(error) from error
        except IdempotencyConflict as error:
            raise Problem(
                409,
                "This Idempotency-Key was used with a different request body.",
                kind="idempotency-key-reused",
            ) from error
        except RequestInProgress as error:
            raise in_progress_problem(
                error,
                unfinished="A request with this Idempotency-Key was received earlier, but the "
                "database could not look it up now; retry with the same Idempotency-Key.",
                pending="A request with this Idempotency-Key is still being accepted; "
                "retry shortly.",
            ) from error
        except Unavailable as error:
            raise _unavailable(error, idempotency_key=idempotency_key) from error
        location = {"Location": status_url(submitted.task_id)}
        if submitted.created and submitted.cached_result is not None:
            admission.created(request)
            return _view_json(_cached_view(submitted, deps.clock()), headers=location)
        status = submitted.status.value
        if not submitted.created:
            try:
                view = await _read_score(submitted.task_id, caller, deps)
            except Unavailable as error:
                # The key's task is recorded here, being scored: answered as recorded. A 503
                # said "nothing was kept", and a client resubmitting without the key then
                # had its text scored twice.
                log.warning("replay of %s answered as recorded: %r", submitted.task_id, error)
                if submitted.cached_result is not None:
                    return _view_json(_cached_view(submitted, deps.clock()), headers=location)
            else:
                if view is not None:
                    return _view_json(view, headers=location)
                # The key's task finished and expired from the status service (the key
                # outlives it): not `queued`, which its status URL (a 404 now) contradicts.
                status = EXPIRED
        accepted = SubmissionAccepted(
            task_id=submitted.task_id, status=status, status_url=status_url(submitted.task_id)
        )
        return JSONResponse(
            accepted.model_dump(), status_code=202 if submitted.created else 200, headers=location
        )

    @router.get(
        "/scores/{task_id}",
        response_model=schemas.TaskView,
        summary="The task's status and, once completed, its score",
        description="With `wait=N` (long-poll, at most 60 s) an unfinished task is answered "
        "after its next state change or after N seconds, whichever comes first; at once when it "
        "is finished or its status differs from `status` (the one the client already has). "
        "Any other query parameter, or one given twice, is refused (422).",
        responses=problem_responses(401, 404, 429, 503),
    )
    async def read(
        request: Request,
        task_id: str,
        caller: Caller = authenticated,
        wait: Annotated[
            float, Query(ge=0, le=60, allow_inf_nan=False, description="Long-poll up to N s.")
        ] = 0,
        status: Annotated[TaskStatus | None, Query(description="The status you have.")] = None,
    ) -> Response:
        if wait > 0 and TASK_ID.match(task_id):
            try:
                view = await unless_gone(
                    request,
                    read_when_changed(
                        lambda: _read_score(task_id, caller, deps),
                        live=deps.live,
                        task_id=task_id,
                        tenant_id=caller.tenant_id,
                        wait_s=wait,
                        known_status=status,
                        settle_s=deps.settings.live_settle_s,
                        clock=deps.clock,
                    ),
                )
            except WaiterLimitReached as error:
                raise waiter_problem(error) from error
            except Unavailable as error:  # the first read: no view to answer with
                raise read_unavailable(error) from error
            except ClientGone:
                return Response(status_code=CLIENT_CLOSED_REQUEST)
            if not await still_valid(caller):
                raise key_ended_while_waiting()
        else:
            view = await _read(task_id, caller, deps)
        if view is None:
            raise Problem(404, f"No task {quoted(task_id)} is known (or it has expired).")
        return _view_json(view)

    return router


class ClientGone(Exception):
    """The client disconnected before its answer was ready."""


# nginx's status for a request its client closed: no client reads it, the metrics do.
CLIENT_CLOSED_REQUEST = 499


async def unless_gone[T](request: Request, work: Coroutine[Any, Any, T]) -> T:
    """`work`'s result, or `ClientGone` (the work cancelled) once the client disconnects.

    uvicorn does not cancel a handler whose client went away: a long-poll whose client gave
    up held its waiter place (of the replica's and the tenant's) and woke to read the status
    service for up to 60 s, and a client retrying on a short timeout held one per try, until
    its tenant was answered 429."""
    answer = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((answer, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (answer, gone):
            if not task.done():
                task.cancel()
        await asyncio.gather(answer, gone, return_exceptions=True)
    if answer.cancelled() or not answer.done():
        raise ClientGone
    return answer.result()


async def _disconnected(request: Request) -> None:
    """Return once the client has disconnected (a GET's empty body read first)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def _read(task_id: str, caller: Caller, deps: GatewayDeps) -> TaskView | None:
    try:
        return await _read_score(task_id, caller, deps)
    except Unavailable as error:
        raise read_unavailable(error) from error


async def _read_score(task_id: str, caller: Caller, deps: GatewayDeps) -> TaskView | None:
    if not TASK_ID.match(task_id):
        return None
    return await read_score(
        task_id,
        tenant_id=caller.tenant_id,
        status=deps.status,
        submissions=deps.submissions,
        clock=deps.clock,
        window=timedelta(seconds=deps.settings.read_your_writes_window_s),
    )
