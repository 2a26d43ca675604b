"""`GET /v1/scores/{task_id}/events`: a task's state changes as Server-Sent Events.

A stream first replays the changes the client has not seen (those after `Last-Event-ID`, from
the status service's history of the task), then sends the live ones as this replica hears
them, and ends after the terminal state. Each event's `id:` is the change's sequence, so a
client that reconnects with `Last-Event-ID` gets exactly what it missed; one that reconnects
after the terminal state gets `204 No Content`, which tells an `EventSource` to stop. A
change heard live that the status service has not recorded yet (it lags by more than
`LIVE_SETTLE_S`, or is away) is sent without an `id:` (its data carries its `sequence`): a
reconnection resumes from the last recorded change and may see it again.

When the status service is away as a stream starts, or the replica's or the tenant's waiters
are at their limit, a client that reconnects by itself (an `EventSource`: it asks for
`text/event-stream`, or sends `Last-Event-ID`) gets a 200 stream holding only `retry:` (the
Retry-After) and no event, so that it comes back; a 503 or 429 would make it stop for good.
Any other client gets the problem. When the replica stops, its streams end at once (the
client resumes elsewhere with `Last-Event-ID`) rather than being cut off when the HTTP
server's drain runs out.

Limits: a comment line every `SSE_HEARTBEAT_S` keeps proxies from closing an idle stream; a
stream lasts at most `SSE_MAX_STREAM_S` (the client resumes with `Last-Event-ID`); the waiters
of a replica and of a tenant are bounded (`LIVE_MAX_WAITERS*`). A client that disconnects
ends its stream at once (the ASGI server reports the disconnect and the stream is cancelled).
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from datetime import timedelta
from typing import Annotated, Any

import orjson
from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from services.gateway.api import TASK_ID, GatewayDeps, read_unavailable, waiter_problem
from services.gateway.auth import Caller
from services.gateway.errors import Unavailable, refused_for_good
from services.gateway.push import (
    HistoryPolicy,
    HistoryReader,
    HistorySource,
    LiveUpdates,
    Settled,
    Waiter,
    WaiterLimitReached,
    history_settled,
    listen_within,
    read_history,
)
from shared.contracts import StateChange, TaskEvent, TaskHistory
from shared.http import Problem, problem_responses, quoted

EVENT_STREAM = "text/event-stream"
# A stream re-reads the history this often even without a live event (a lost live event
# costs at most this much latency).
RESYNC_S = 60.0
# How long a stream's heartbeat waits for the live queue's binding when it is not bound.
REBIND_WITHIN_S = 1.0
LAST_EVENT_ID = re.compile(r"^[0-9]{1,18}$")  # ASCII digits: `\d` takes any script's

_EXAMPLE_STREAM = (
    "retry: 3000\n\n"
    'id: 0\ndata: {"task_id": "6f1c…", "sequence": 0, "status": "queued", '
    '"occurred_at": "2025-01-01T12:00:00Z", "attempt": 0}\n\n'
    'id: 110\ndata: {"task_id": "6f1c…", "sequence": 110, "status": "processing", '
    '"occurred_at": "2025-01-01T12:00:01Z", "attempt": 1}\n\n'
    ": keep-alive\n\n"
    'id: 190\ndata: {"task_id": "6f1c…", "sequence": 190, "status": "completed", '
    '"occurred_at": "2025-01-01T12:00:03Z", "attempt": 1, '
    '"result": {"score": 7.5, "comment": "Clear.", "model": "gpt-4o-mini"}}\n\n'
)


def _after(last_event_id: str | None) -> int:
    if last_event_id is None or not last_event_id.strip():
        return -1
    if not LAST_EVENT_ID.match(last_event_id.strip()):
        raise Problem(400, "Last-Event-ID must be the id of an event of this stream (a number).")
    return int(last_event_id)


def _frame(task_id: str, change: StateChange, *, resumable: bool = True) -> bytes:
    """One SSE frame; `resumable=False` for a change heard live that the status service has
    not recorded yet: no `id`, so a reconnection resumes from the last recorded one (and may
    see this change again, once recorded)."""
    data = orjson.dumps({"task_id": task_id, **change.model_dump(mode="json", exclude_none=True)})
    if not resumable:
        return b"data: %s\n\n" % data
    return b"id: %d\ndata: %s\n\n" % (change.sequence, data)


def event_routes(
    deps: GatewayDeps,
    live: LiveUpdates,
    history: HistorySource,
    authenticated: Any,
    still_valid: Callable[[Caller], Awaitable[bool]],
) -> APIRouter:
    """The SSE route; `history` is the status service's history reader."""
    router = APIRouter(prefix="/v1", tags=["scores"])
    settings = deps.settings
    policy = HistoryPolicy(window=timedelta(seconds=settings.read_your_writes_window_s))

    @router.get(
        "/scores/{task_id}/events",
        response_class=StreamingResponse,
        summary="Stream the task's state changes (Server-Sent Events)",
        description="Replays the changes after `Last-Event-ID` (all of them without it), then "
        "streams each new one, and ends after `completed` or `failed`. Each event's `id` is its "
        "sequence and its `data` a JSON object: `task_id`, `sequence`, `status`, "
        "`occurred_at`, `attempt`, and `error`/`next_attempt_at` (retrying, failed) or "
        "`result` (completed). Comment lines are heartbeats.",
        responses={
            200: {
                "description": "The event stream.",
                "content": {
                    EVENT_STREAM: {"schema": {"type": "string"}, "example": _EXAMPLE_STREAM}
                },
            },
            204: {"description": "The task finished and the client has seen every change."},
            **problem_responses(400, 401, 404, 429, 503),
        },
    )
    async def stream_task_events(
        task_id: str,
        request: Request,
        caller: Caller = authenticated,
        last_event_id: str | None = Header(default=None, alias="Last-Event-ID"),
        last_event_id_query: Annotated[
            str | None,
            Query(
                alias="lastEventId",
                description="`Last-Event-ID` for clients that cannot send headers on a "
                "reconnection (EventSource polyfills add it to the URL); the header wins.",
            ),
        ] = None,
    ) -> Response:
        after = _after(last_event_id if last_event_id is not None else last_event_id_query)
        if not TASK_ID.match(task_id):
            raise Problem(404, f"No task {quoted(task_id)} is known (or it has expired).")

        async def read(since: int) -> TaskHistory | None:
            return await read_history(
                task_id,
                tenant_id=caller.tenant_id,
                after=since,
                status=history,
                submissions=deps.submissions,
                clock=deps.clock,
                policy=policy,
            )

        try:
            waiter = live.open(task_id, caller.tenant_id)  # before the read: no event slips by
        except WaiterLimitReached as error:
            if _reconnects_by_itself(request):
                return _come_back_later(
                    "too many requests wait for live updates", error.retry_after_s
                )
            raise waiter_problem(error) from error
        try:
            # Bounded: a bind stuck on a broker away held the stream's headers (and its waiter
            # place) for as long as the bind took; one not bound yet is retried at heartbeats.
            await listen_within(live, REBIND_WITHIN_S)
            first = await read(after)
        except Unavailable as error:
            live.close(waiter)
            if _reconnects_by_itself(request) and not refused_for_good(error):
                return _come_back_later("the task's history is unavailable", error.retry_after_s)
            raise read_unavailable(error) from error
        except BaseException:
            live.close(waiter)
            raise
        if first is None:
            live.close(waiter)
            raise Problem(404, f"No task {quoted(task_id)} is known (or it has expired).")
        if after > first.sequence:  # no event of the task has that id: nothing would match
            live.close(waiter)
            raise Problem(
                400,
                f"Last-Event-ID {after} is ahead of the task's latest event ({first.sequence}).",
            )
        if first.status.is_terminal and not first.changes:
            live.close(waiter)
            return Response(status_code=204)

        async def authorised() -> bool:
            return await still_valid(caller)

        stream = _stream(
            task_id,
            first,
            after=after,
            waiter=waiter,
            read=read,
            authorised=authorised,
            live=live,
            heartbeat_s=settings.sse_heartbeat_s,
            max_stream_s=settings.sse_max_stream_s,
            retry_ms=settings.sse_retry_ms,
            settle_s=settings.live_settle_s,
        )

        async def close_waiter() -> None:
            live.close(waiter)

        return StreamingResponse(
            stream,
            media_type=EVENT_STREAM,
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
            # Also closes the waiter of a stream that never started (client gone at once). A
            # coroutine function, so that it runs on the event loop: Starlette runs a plain
            # function in a worker thread, where the close raced the loop's `open`/`deliver`
            # on the registry's sets and counters.
            background=BackgroundTask(close_waiter),
        )

    return router


def _reconnects_by_itself(request: Request) -> bool:
    """An `EventSource` (it asks for `text/event-stream`, and sends `Last-Event-ID` when it
    reconnects, a polyfill as `?lastEventId=`): it stops for good on any answer but 200 or
    204, a 503 included."""
    accepts = request.headers.get("accept", "")
    reconnecting = "last-event-id" in request.headers or "lastEventId" in request.query_params
    return EVENT_STREAM in accepts or reconnecting


def _come_back_later(reason: str, retry_after_s: float) -> Response:
    """A stream with nothing in it but when to reconnect, for the length of an outage of the
    status service or while the waiters are at their limit: the client comes back with the
    same `Last-Event-ID`, as after any stream's end. It says nothing of the task (not even
    whether it exists)."""
    body = b": %s; reconnecting\nretry: %d\n\n" % (reason.encode(), int(retry_after_s * 1000))
    return Response(
        body,
        media_type=EVENT_STREAM,
        headers={"Cache-Control": "no-cache", "Retry-After": str(retry_after_s)},
    )


async def _stream(
    task_id: str,
    first: TaskHistory,
    *,
    after: int,
    waiter: Waiter,
    read: HistoryReader,
    authorised: Callable[[], Awaitable[bool]],
    live: LiveUpdates,
    heartbeat_s: float,
    max_stream_s: float,
    retry_ms: int,
    settle_s: float,
) -> AsyncIterator[bytes]:
    clock = asyncio.get_running_loop().time
    last = after
    try:
        yield b"retry: %d\n\n" % retry_ms
        for change in first.changes:
            yield _frame(task_id, change)
            last = change.sequence
        if first.status.is_terminal:
            return
        ends_at, resync_at = clock() + max_stream_s, clock() + RESYNC_S
        while (remaining := ends_at - clock()) > 0:
            event = await waiter.next(min(heartbeat_s, remaining))
            if waiter.stopped:
                return  # the replica is stopping: the client resumes on another
            if event is None:
                if not await authorised():
                    return  # its key was revoked
                yield b": keep-alive\n\n"
                await _bind_if_unbound(live)
                if not waiter.missed and clock() < resync_at:
                    continue
                waiter.missed, resync_at = False, clock() + RESYNC_S
            elif event.sequence <= last:
                continue
            settled = await _changes_after(last, event, read=read, settle_s=settle_s)
            # Expired meanwhile (nothing more will come), or its key revoked: the key is asked
            # before changes are sent, not only at heartbeats (a task whose changes came within
            # a heartbeat of each other streamed on, its result included, to a revoked key).
            if settled is None or (settled.changes and not await authorised()):
                return
            changes = settled.changes
            for change in changes:
                yield _frame(task_id, change, resumable=change.sequence <= settled.recorded)
                last = change.sequence
            if changes and changes[-1].status.is_terminal:
                return
    finally:
        live.close(waiter)


async def _bind_if_unbound(live: LiveUpdates) -> None:
    """Bind the live queue if nothing has since a failed bind: a stream opened while the
    broker was away heard changes only at its periodic re-read, for its whole life. A bind
    marks every waiter `missed` (`LiveUpdates.note_bound`), whoever made it: the stream then
    re-reads what changed before it."""
    if not live.listening:
        await listen_within(live, REBIND_WITHIN_S)


async def _changes_after(
    last: int, event: TaskEvent | None, *, read: HistoryReader, settle_s: float
) -> Settled | None:
    """The changes after `last`: once they include `event`, or as they are (a resync)."""
    if event is not None:
        settled = await history_settled(read, after=last, event=event, settle_s=settle_s)
    else:
        try:
            history = await read(last)
        except Unavailable:
            return Settled([], last)  # the status service is away: live events go on
        if history is None:
            return None
        settled = Settled(history.changes, max([last, *(c.sequence for c in history.changes)]))
    newer = [change for change in settled.changes if change.sequence > last]
    return Settled(newer, settled.recorded)
