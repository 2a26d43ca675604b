"""The batch routes (`POST /v1/batches`, `GET /v1/batches`, `GET /v1/batches/{batch_id}`): thin
adapters from HTTP to `services.gateway.batches`, with the same body checks as single
submissions (415, 413, 400, 422 — an invalid item names its index, and nothing of the batch is
kept)."""

from __future__ import annotations

import base64
import re
from collections.abc import Awaitable, Callable, Iterator
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

from fastapi import APIRouter, Header, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from services.gateway.admission import weigh
from services.gateway.api import (
    GatewayDeps,
    _check_idempotency_key,
    _unavailable,
    in_progress_problem,
    read_unavailable,
    status_url,
    submission_responses,
)
from services.gateway.auth import Caller, Callers
from services.gateway.batches import (
    MAX_TEXT_CHARS_CONTEXT,
    Batches,
    BatchItem,
    BatchPage,
    BatchPolicy,
    BatchPublisher,
    BatchStatusReader,
    BatchSubmission,
    ListedBatch,
    ListPosition,
    read_batch,
    submit_batch,
)
from services.gateway.errors import (
    IdempotencyConflict,
    RequestInProgress,
    Unavailable,
)
from services.gateway.limits import LimitExceeded, limit_problem
from services.gateway.schemas import ALLOWED_MODELS_CONTEXT, EXPIRED
from services.gateway.settings import GatewaySettings
from shared.bodies import (
    Location,
    read_json_object,
    refuse_many_unknown_fields,
    unknown_fields,
)
from shared.contracts import Instant, ScoreResult, TaskFailure
from shared.http import (
    Problem,
    described_errors,
    invalid_query,
    problem_responses,
    quoted,
)

BATCH_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}\Z")
# ASCII digits: `\d` takes any script's (U+0661, ARABIC-INDIC DIGIT ONE), which `int` reads.
CURSOR = re.compile(r"^[0-9]{1,7}\Z")
DEFAULT_PAGE = 100
DEFAULT_LISTED, MAX_LISTED = 20, 100
# A listing's cursor, base64url of "<created_at in ms>:<batch id>": a position only, which
# lists the caller's own batches from it, whoever's listing it came from (it carried a hash
# of the tenant's id, unsalted: a cursor seen in a log confirmed a guessed tenant name; a
# walkthrough). 14 digits of milliseconds reach the year 5138; more could pass `datetime`'s
# year 9999 (a 500).
LIST_CURSOR = re.compile(r"^[A-Za-z0-9_-]{1,200}\Z")
LIST_POSITION = re.compile(r"^([0-9]{1,14}):([A-Za-z0-9_-]{1,64})\Z")
EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
MILLISECOND = timedelta(milliseconds=1)


def batch_url(batch_id: str) -> str:
    return f"/v1/batches/{batch_id}"


def unknown_batch(batch_id: str) -> Problem:
    """404: no such batch of the caller's (never revealing another tenant's)."""
    return Problem(404, f"No batch {quoted(batch_id)} is known (or it has expired).")


class AcceptedItem(BaseModel):
    index: int = Field(description="Position in the request.")
    client_id: str | None = None
    task_id: str
    status_url: str


class BatchAccepted(BaseModel):
    """`202 Accepted`: the batch id and one task id per item, in the request's order."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "batch_id": "0b7f3c1e9d2a4b6f8e1d3c5a7b9f0e2d",
                    "status_url": "/v1/batches/0b7f3c1e9d2a4b6f8e1d3c5a7b9f0e2d",
                    "total": 2,
                    "items": [
                        {
                            "index": 0,
                            "client_id": "doc-1",
                            "task_id": "6f1c0c0b3b0b4d8a9f7e1f3f0a9d2c11",
                            "status_url": "/v1/scores/6f1c0c0b3b0b4d8a9f7e1f3f0a9d2c11",
                        },
                        {
                            "index": 1,
                            "client_id": "doc-2",
                            "task_id": "9a8b7c6d5e4f40312a1b0c9d8e7f6a5b",
                            "status_url": "/v1/scores/9a8b7c6d5e4f40312a1b0c9d8e7f6a5b",
                        },
                    ],
                }
            ]
        }
    )

    batch_id: str
    status_url: str = Field(examples=["/v1/batches/0b7f3c1e9d2a4b6f8e1d3c5a7b9f0e2d"])
    total: int
    items: list[AcceptedItem]


class BatchItemView(BaseModel):
    index: int
    client_id: str | None = None
    task_id: str
    status: str = Field(
        description="A task status, or `expired` once its result is no longer kept.",
        examples=["completed"],
    )
    attempts: int = 0
    result: ScoreResult | None = None
    error: TaskFailure | None = None
    status_url: str


class BatchView(BaseModel):
    """A batch's progress: counts per status and one page of its items, in request order."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "batch_id": "0b7f3c1e9d2a4b6f8e1d3c5a7b9f0e2d",
                    "total": 2,
                    "created_at": "2030-05-17T12:00:00Z",
                    "counts": {"queued": 0, "processing": 1, "completed": 1, EXPIRED: 0},
                    "items": [
                        {
                            "index": 0,
                            "client_id": "doc-1",
                            "task_id": "6f1c0c0b3b0b4d8a9f7e1f3f0a9d2c11",
                            "status": "completed",
                            "attempts": 1,
                            "result": {"score": 7.5, "comment": "Clear.", "model": "gpt-4o-mini"},
                            "error": None,
                            "status_url": "/v1/scores/6f1c0c0b3b0b4d8a9f7e1f3f0a9d2c11",
                        }
                    ],
                    "next_cursor": "1",
                }
            ]
        }
    )

    batch_id: str
    total: int
    created_at: Instant
    counts: dict[str, int] = Field(
        examples=[
            {
                "scheduled": 0,
                "queued": 3,
                "processing": 2,
                "retrying": 1,
                "completed": 93,
                "failed": 1,
                EXPIRED: 0,
            }
        ]
    )
    items: list[BatchItemView]
    next_cursor: str | None = Field(
        default=None, description="Pass as `cursor` for the next page; null on the last page."
    )
    acceptance: Literal["accepted", "accepting", "incomplete"] = Field(
        default="accepted",
        description="`accepting`: its request may still be recording or sending its items "
        "(they read `queued`). `incomplete`: its request ended before recording every item "
        "(its answer lost); a batch sent with an Idempotency-Key is completed by a replay of "
        "it with that key until `refused_at`; otherwise it is refused whole then, none of "
        "its items scored.",
    )
    refused_at: Instant | None = Field(
        default=None,
        description="When an `incomplete` batch is refused (unless a replay completes it); "
        "it may read a moment past, until the refusal's pass comes.",
    )


class ListedBatchView(BaseModel):
    batch_id: str
    created_at: Instant
    total: int = Field(description="Items in the batch.")
    status_url: str = Field(description="The batch's progress (`GET /v1/batches/{batch_id}`).")


class BatchList(BaseModel):
    """A page of the tenant's batches, newest first."""

    model_config = ConfigDict(
        json_schema_extra={
            "examples": [
                {
                    "count": 1,
                    "items": [
                        {
                            "batch_id": "0b7f3c1e9d2a4b6f8e1d3c5a7b9f0e2d",
                            "created_at": "2030-05-17T12:00:00.125000Z",
                            "total": 2,
                            "status_url": "/v1/batches/0b7f3c1e9d2a4b6f8e1d3c5a7b9f0e2d",
                        }
                    ],
                    "next_cursor": "MTkwNTI0OTYwMDEyNTowYjdmM2MxZTlkMmE0YjZmOGUxZDNjNWE3YjlmMGUyZA",
                }
            ]
        }
    )

    count: int
    items: list[ListedBatchView]
    next_cursor: str | None = Field(
        default=None, description="Pass as `cursor` for the next page; null on the last page."
    )


def list_cursor(position: ListPosition) -> str:
    millis = (position.created_at - EPOCH) // MILLISECOND
    raw = f"{millis}:{position.batch_id}"
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


BATCH_CURSOR_REFUSED = "is not a `next_cursor` this batch returned"


def listing_position(cursor: str) -> ListPosition:
    """The position a listing's `next_cursor` names; a 422 naming `cursor` when it is none."""
    found = LIST_POSITION.match(_decoded(cursor)) if LIST_CURSOR.match(cursor) else None
    if found is None:
        raise invalid_query("cursor", "is not a `next_cursor` of this listing")
    millis, batch_id = found.groups()
    return ListPosition(EPOCH + int(millis) * MILLISECOND, batch_id)


def _decoded(cursor: str) -> str:
    try:
        return base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode("ascii")
    except ValueError:  # binascii.Error, UnicodeDecodeError
        return ""


def _list_view(listed: list[ListedBatch], limit: int) -> BatchList:
    """A page of `limit` batches out of `listed` (`limit + 1` read: one more says there is a
    next page)."""
    page = listed[:limit]
    more = len(listed) > limit
    return BatchList(
        count=len(page),
        items=[
            ListedBatchView(
                batch_id=batch.batch_id,
                created_at=batch.created_at,
                total=batch.total,
                status_url=batch_url(batch.batch_id),
            )
            for batch in page
        ],
        next_cursor=list_cursor(page[-1].position) if more else None,
    )


def _field(location: tuple[int | str, ...]) -> str:
    field = ""
    for part in location:
        field += f"[{part}]" if isinstance(part, int) else f".{part}" if field else str(part)
    return field or "body"


def _unknown_fields_of_batch(payload: dict[str, Any]) -> Iterator[Location]:
    yield from unknown_fields(payload, BatchSubmission)
    items = payload.get("items")
    for index, item in enumerate(items if isinstance(items, list) else ()):
        if isinstance(item, dict):
            yield from unknown_fields(item, BatchItem, ("items", index))


def _items_named(locations: list[Location]) -> dict[str, Any]:
    return {"invalid_items": sorted({at[1] for at in locations if at[0] == "items"})}


def _refuse_long_texts(items: Any, limit: int) -> None:
    """413, as for a single submission, naming the items whose text is over `limit`."""
    if not isinstance(items, list):
        return
    too_long = [
        index
        for index, item in enumerate(items)
        if isinstance(item, dict)
        and isinstance(item.get("text"), str)
        and len(item["text"]) > limit
    ]
    if too_long:
        raise Problem(
            413,
            f"items {too_long}: a text has at most {limit} characters.",
            kind="text-too-long",
            invalid_items=too_long,
        )


async def parse_batch(
    request: Request,
    settings: GatewaySettings,
    *,
    arrived: Callable[[], Awaitable[None]] | None = None,
) -> BatchSubmission:
    payload = await read_json_object(
        request, what="batch", limit=settings.max_batch_body_bytes, arrived=arrived
    )
    items = payload.get("items")
    if isinstance(items, list) and len(items) > settings.max_batch_items:
        message = f"a batch has at most {settings.max_batch_items} items, not {len(items)}"
        raise Problem(
            422,
            f"items: {message}.",
            kind="invalid-fields",
            errors=[{"field": "items", "message": message}],
            invalid_items=[],
        )
    refuse_many_unknown_fields(_unknown_fields_of_batch(payload), _field, _items_named)
    _refuse_long_texts(items, settings.max_text_chars)
    try:
        context = {
            MAX_TEXT_CHARS_CONTEXT: settings.max_text_chars,
            ALLOWED_MODELS_CONTEXT: settings.allowed_models,
        }
        batch = BatchSubmission.model_validate(payload, context=context)
    except ValidationError as error:
        found = error.errors(include_url=False)
        detail, errors = described_errors(found, lambda e: _field(tuple(e["loc"])))
        invalid = sorted(
            {e["loc"][1] for e in found if len(e["loc"]) > 1 and e["loc"][0] == "items"}
        )
        raise Problem(
            422, detail, kind="invalid-fields", errors=errors, invalid_items=invalid
        ) from error
    duplicate = batch.duplicate_client_id()
    if duplicate is not None:
        index, client_id = duplicate
        raise Problem(
            422,
            f"items[{index}].client_id: {client_id!r} is already used by an earlier item.",
            kind="invalid-fields",
            errors=[{"field": f"items[{index}].client_id", "message": "duplicate client_id"}],
            invalid_items=[index],
        )
    return batch


def _page_view(page: BatchPage) -> BatchView:
    return BatchView(
        batch_id=page.batch_id,
        total=page.total,
        created_at=page.created_at,
        counts=page.counts,
        items=[
            BatchItemView(
                index=item.index,
                client_id=item.client_id,
                task_id=item.task_id,
                status=item.status,
                attempts=item.attempts,
                result=item.result,
                error=item.error,
                status_url=status_url(item.task_id),
            )
            for item in page.items
        ],
        next_cursor=None if page.next_cursor is None else str(page.next_cursor),
        acceptance=page.acceptance,
        refused_at=page.refused_at,
    )


def batch_routes(
    deps: GatewayDeps,
    *,
    batches: Batches,
    publisher: BatchPublisher,
    status: BatchStatusReader,
    callers: Callers,
) -> APIRouter:
    """The batch routes; `status` reads batch progress from the status service, `callers`
    are the dependencies that yield a `Caller`."""
    router = APIRouter(prefix="/v1", tags=["batches"])
    authenticated = callers.authenticated
    settings = deps.settings
    policy = BatchPolicy(
        max_attempts=settings.max_attempts,
        retention=timedelta(seconds=settings.idempotency_ttl_s),
        in_progress_for=timedelta(seconds=settings.outbox_grace_s),
        default_model=settings.default_model,
    )
    window = timedelta(seconds=settings.read_your_writes_window_s)

    @router.post(
        "/batches",
        status_code=202,
        response_model=BatchAccepted,
        summary="Submit up to 1,000 texts for scoring in one request",
        description="Every item is validated first: one invalid item answers 422 naming its "
        "index (`invalid_items`) and nothing is kept. The answer lists one task id per item, in "
        "the request's order; each task is also readable on its own at `status_url`.",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": BatchSubmission.model_json_schema()}},
            }
        },
        responses=submission_responses(
            {
                "description": "The same Idempotency-Key and body: the earlier batch.",
                "model": BatchAccepted,
            }
        ),
    )
    async def submit(
        request: Request,
        idempotency_key: str | None = Header(default=None, alias="Idempotency-Key"),
        caller: Caller = callers.identified,
    ) -> JSONResponse:
        batch = await callers.read_counted(caller, parse_batch, request, settings)
        weigh(request, len(batch.items))
        try:
            submitted = await submit_batch(
                batch,
                tenant_id=caller.tenant_id,
                api_key_id=caller.key_id,
                idempotency_key=_check_idempotency_key(idempotency_key, request),
                batches=batches,
                submissions=deps.submissions,
                publisher=publisher,
                policy=policy,
                clock=deps.clock,
                refusals=deps.refusals,
                in_flight=deps.in_flight,
            )
        except LimitExceeded as error:
            raise limit_problem(error) from error
        except IdempotencyConflict as error:
            raise Problem(
                409,
                "This Idempotency-Key was used with a different batch.",
                kind="idempotency-key-reused",
            ) from error
        except RequestInProgress as error:
            raise in_progress_problem(
                error,
                unfinished="A batch with this Idempotency-Key is kept, but the database could "
                "not complete its answer now; retry with the same Idempotency-Key.",
                pending="A batch with this Idempotency-Key is still being accepted; retry shortly.",
            ) from error
        except Unavailable as error:
            raise _unavailable(error, idempotency_key=idempotency_key) from error
        record = submitted.record
        accepted = BatchAccepted(
            batch_id=record.batch_id,
            status_url=batch_url(record.batch_id),
            total=len(record.members),
            items=[
                AcceptedItem(
                    index=index,
                    client_id=member.client_id,
                    task_id=member.task_id,
                    status_url=status_url(member.task_id),
                )
                for index, member in enumerate(record.members)
            ],
        )
        return JSONResponse(
            accepted.model_dump(),
            status_code=202 if submitted.created else 200,
            headers={"Location": batch_url(record.batch_id)},
        )

    @router.get(
        "/batches",
        response_model=BatchList,
        summary="Your tenant's batches, newest first",
        description="Each batch with its creation time, item count and `status_url`, "
        "`limit` per page; follow `next_cursor` until it is null to see every batch exactly "
        "once. Finds a batch whose 202 was lost (no `batch_id` came back). A batch whose "
        "request is still being accepted is listed like any other (its `status_url` tells "
        "its items' progress); should that request be refused after all (429, 503: nothing "
        "kept) it leaves the listing. Expired batches are not listed. A `cursor` names a "
        "position only: one that is not a `next_cursor`, and any other query parameter or "
        "one given twice, are refused (422).",
        responses=problem_responses(401, 429, 503),
    )
    async def list_batches(
        cursor: str | None = Query(default=None, description="`next_cursor` of the last page."),
        limit: int = Query(
            default=DEFAULT_LISTED, ge=1, le=MAX_LISTED, description="Batches per page."
        ),
        caller: Caller = authenticated,
    ) -> BatchList:
        after = None if cursor is None else listing_position(cursor)
        try:
            listed = await batches.newest(
                caller.tenant_id, now=deps.clock(), after=after, limit=limit + 1
            )
        except Unavailable as error:
            raise read_unavailable(error) from error
        return _list_view(listed, limit)

    @router.get(
        "/batches/{batch_id}",
        response_model=BatchView,
        summary="A batch's progress: counts per status and a page of its items with results",
        description="Items come in the request's order, `limit` per page; follow `next_cursor` "
        "until it is null to see every item exactly once. Right after the 202 the counts may "
        "lag: tasks not yet seen by the status service count as `queued`. Any other query "
        "parameter, or one given twice, or a `cursor` that is no `next_cursor` of this batch, "
        "is refused (422).",
        responses=problem_responses(401, 404, 422, 429, 503),
    )
    async def read(
        batch_id: str,
        cursor: str | None = Query(default=None, description="`next_cursor` of the last page."),
        limit: int = Query(default=DEFAULT_PAGE, ge=1, le=1000, description="Items per page."),
        caller: Caller = authenticated,
    ) -> BatchView:
        missing = unknown_batch(batch_id)
        if not BATCH_ID.match(batch_id):
            raise missing
        # A 422 naming `query.cursor`, as the listing's and every invalid query parameter's:
        # a 400 without `errors` (found in a walkthrough).
        if cursor is not None and not CURSOR.match(cursor):
            raise invalid_query("cursor", BATCH_CURSOR_REFUSED)
        start = int(cursor or 0)
        try:
            page = await read_batch(
                batch_id,
                tenant_id=caller.tenant_id,
                start=start,
                limit=limit,
                batches=batches,
                status=status,
                submissions=deps.submissions,
                clock=deps.clock,
                window=window,
                grace=policy.in_progress_for,
            )
        except Unavailable as error:
            raise read_unavailable(error) from error
        if page is None:
            raise missing
        if start and start >= page.total:
            raise invalid_query("cursor", BATCH_CURSOR_REFUSED)
        return _page_view(page)

    return router
