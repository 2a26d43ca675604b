"""The adaptive limit of submissions at once (`services/gateway/admission.py`)."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field

import pytest
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from services.gateway.admission import (
    BACKOFF,
    REPORT_INTERVAL_S,
    AdaptiveLimit,
    SubmissionAdmission,
    created,
    route_path,
    weigh,
)
from tests.support import eventually

TARGET_S = 1.0
SUBMISSION: Scope = {"type": "http", "method": "POST", "path": "/v1/scores", "headers": []}


@dataclass
class Clock:
    now: float = 100.0

    def __call__(self) -> float:
        return self.now


def limit(*, initial: int = 10, clock: Clock | None = None) -> AdaptiveLimit:
    return AdaptiveLimit(
        target_s=TARGET_S,
        min_limit=4,
        max_limit=20,
        initial_limit=initial,
        clock=clock or Clock(),
    )


async def refused_only(scope: Scope, receive: Receive, send: Send) -> None:
    """A route that reads its body first, as the submission routes do: a refused request is
    refused in that read, and never gets past it."""
    await receive()
    raise AssertionError("a refused request must not get past its body")


async def answered(scope: Scope, receive: Receive, send: Send) -> None:
    """A route that reads its body in full and answers 202."""
    while (await receive()).get("more_body", False):
        pass
    await send({"type": "http.response.start", "status": 202, "headers": []})
    await send({"type": "http.response.body", "body": b""})


def statuses_into(sent: list[int]) -> Send:
    async def send(message: Message) -> None:
        if message["type"] == "http.response.start":
            sent.append(message["status"])

    return send


async def receive() -> Message:
    return {"type": "http.request", "body": b"", "more_body": False}


def fill(adaptive: AdaptiveLimit) -> int:
    taken = 0
    while adaptive.try_acquire():
        taken += 1
    return taken


def test_it_admits_up_to_its_limit_and_takes_back_what_is_released() -> None:
    adaptive = limit(initial=10)
    assert fill(adaptive) == 10
    assert not adaptive.try_acquire()
    adaptive.release(took_s=0.01)
    assert adaptive.try_acquire()


def test_a_slow_submission_shrinks_the_limit_once_per_target_interval() -> None:
    clock = Clock()
    adaptive = limit(initial=10, clock=clock)
    fill(adaptive)
    adaptive.release(took_s=2.0)
    assert adaptive.limit == 10 * BACKOFF
    adaptive.release(took_s=2.0)  # the same moment of slowness: no second cut
    assert adaptive.limit == 10 * BACKOFF
    clock.now += TARGET_S
    adaptive.release(took_s=2.0)
    assert adaptive.limit == 10 * BACKOFF * BACKOFF


def test_the_limit_never_falls_below_its_floor_nor_grows_past_its_ceiling() -> None:
    clock = Clock()
    adaptive = limit(initial=10, clock=clock)
    for _ in range(50):
        assert adaptive.try_acquire()
        adaptive.release(took_s=5.0)
        clock.now += TARGET_S
    assert adaptive.limit == 4
    for _ in range(1000):
        fill(adaptive)
        while adaptive.in_flight:
            adaptive.release(took_s=0.01)
    assert adaptive.limit == 20


def test_quick_submissions_grow_a_limit_in_use_but_not_an_idle_one() -> None:
    idle = limit(initial=10)
    for _ in range(20):
        assert idle.try_acquire()
        idle.release(took_s=0.01)  # one at a time: half of the limit is never in use
    assert idle.limit == 10

    busy = limit(initial=10)
    fill(busy)
    busy.release(took_s=TARGET_S / 2)  # within half the target: one more place
    assert busy.limit == 11


def test_submissions_between_half_the_target_and_the_target_hold_the_limit() -> None:
    adaptive = limit(initial=10)
    fill(adaptive)
    for _ in range(5):
        adaptive.release(took_s=TARGET_S * 0.75)
        assert adaptive.try_acquire()
    adaptive.release(took_s=TARGET_S)
    assert adaptive.limit == 10


def test_a_submission_that_measured_nothing_only_frees_its_place() -> None:
    adaptive = limit(initial=10)
    fill(adaptive)
    adaptive.release(took_s=None)
    assert adaptive.limit == 10
    assert adaptive.in_flight == 9


def test_the_initial_limit_is_kept_within_its_bounds() -> None:
    assert limit(initial=1).limit == 4
    assert limit(initial=64).limit == 20


async def test_shedding_is_logged_once_per_interval_with_the_refusals_since(
    caplog: pytest.LogCaptureFixture,
) -> None:
    clock = Clock()
    adaptive = AdaptiveLimit(
        target_s=TARGET_S, min_limit=1, max_limit=1, initial_limit=1, clock=clock
    )
    sent: list[int] = []
    send = statuses_into(sent)

    middleware = SubmissionAdmission(
        refused_only, limit=adaptive, guarded=[("POST", "/v1/scores")], clock=clock
    )
    scope: Scope = {"type": "http", "method": "POST", "path": "/v1/scores", "headers": []}
    assert adaptive.try_acquire()  # the one place is taken
    with caplog.at_level(logging.WARNING, logger="scorebox.gateway.admission"):
        for _ in range(3):
            await middleware(scope, receive, send)
        clock.now += REPORT_INTERVAL_S
        await middleware(scope, receive, send)
    assert sent == [503] * 4
    reports = [r.getMessage() for r in caplog.records]
    assert len(reports) == 2
    assert reports[0].startswith("shedding submissions: 1 refused")
    assert reports[1].startswith("shedding submissions: 3 refused")


@pytest.mark.parametrize(
    ("root_path", "path", "routed"),
    [
        ("", "/v1/scores", "/v1/scores"),
        ("/api", "/api/v1/scores", "/v1/scores"),
        ("/api", "/apiv1/scores", "/apiv1/scores"),
        ("/api", "/v1/scores", "/v1/scores"),
    ],
)
def test_guarded_paths_are_matched_below_a_mount_prefix(
    root_path: str, path: str, routed: str
) -> None:
    scope: Scope = {"type": "http", "method": "POST", "path": path, "root_path": root_path}
    assert route_path(scope) == routed


async def test_a_submission_under_a_mount_prefix_is_guarded() -> None:
    adaptive = limit(initial=4)
    sent: list[int] = []
    send = statuses_into(sent)

    middleware = SubmissionAdmission(refused_only, limit=adaptive, guarded=[("POST", "/v1/scores")])
    fill(adaptive)
    scope: Scope = {
        "type": "http",
        "method": "POST",
        "path": "/api/v1/scores",
        "root_path": "/api",
        "headers": [],
    }
    await middleware(scope, receive, send)
    assert sent == [503]


@dataclass
class StalledUploads:
    """Request bodies sent in two halves, the second only once `gate` is set."""

    gate: asyncio.Event = field(default_factory=asyncio.Event)
    waiting: int = 0  # how many were asked for their second half

    def receive(self) -> Receive:
        halves = [b'{"text": "a slow', b' upload"}']

        async def receive() -> Message:
            more = len(halves) == 2
            if not more:
                self.waiting += 1
                await self.gate.wait()
            return {"type": "http.request", "body": halves.pop(0), "more_body": more}

        return receive


async def test_an_upload_holds_no_place_until_its_body_has_arrived() -> None:
    adaptive = limit(initial=4)
    sent: list[int] = []
    middleware = SubmissionAdmission(answered, limit=adaptive, guarded=[("POST", "/v1/scores")])
    uploads = StalledUploads()
    stalled = [
        asyncio.create_task(middleware(SUBMISSION, uploads.receive(), statuses_into(sent)))
        for _ in range(int(adaptive.limit))
    ]

    async def all_stalled() -> bool:
        return uploads.waiting == len(stalled)

    await eventually(all_stalled, what="every upload waiting for its second half")
    assert adaptive.in_flight == 0

    await middleware(SUBMISSION, receive, statuses_into(sent))  # another client's, in full
    assert sent == [202]

    uploads.gate.set()
    await asyncio.gather(*stalled)
    assert sent == [202] * (1 + len(stalled))
    assert adaptive.in_flight == 0


async def test_a_submission_holds_its_place_from_the_end_of_its_body_until_answered() -> None:
    adaptive = limit(initial=4)
    holding: list[int] = []

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        holding.append(adaptive.in_flight)
        await answered(scope, receive, send)

    middleware = SubmissionAdmission(route, limit=adaptive, guarded=[("POST", "/v1/scores")])
    await middleware(SUBMISSION, receive, statuses_into([]))
    assert holding == [1]
    assert adaptive.in_flight == 0


async def test_a_request_answered_before_its_body_takes_no_place() -> None:
    adaptive = limit(initial=4)
    fill(adaptive)
    sent: list[int] = []

    async def unauthenticated(scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 401, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = SubmissionAdmission(
        unauthenticated, limit=adaptive, guarded=[("POST", "/v1/scores")]
    )
    await middleware(SUBMISSION, receive, statuses_into(sent))
    assert sent == [401]  # not 503: it asked nothing of what the limit protects
    assert adaptive.in_flight == 4


@pytest.mark.parametrize(
    ("status", "grows"), [(202, True), (200, False), (422, False), (409, False)]
)
async def test_only_an_accepted_submission_grows_the_limit(status: int, grows: bool) -> None:
    """A malformed body refused at once, or a replay's 200, was a quick submission too:
    during an overload it grew the limit place by place, and every slow submission was let
    in again (two reviews)."""
    adaptive = limit(initial=4)
    adaptive.try_acquire()  # another submission in hand: half the limit in use

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = SubmissionAdmission(route, limit=adaptive, guarded=[("POST", "/v1/scores")])
    await middleware(SUBMISSION, receive, statuses_into([]))
    assert adaptive.limit == (5 if grows else 4)


@pytest.mark.parametrize(("status", "grows"), [(200, True), (422, False)])
async def test_a_submission_answered_from_the_cache_grows_the_limit(
    status: int, grows: bool
) -> None:
    """A result-cache hit creates a task (a record, its announcement) and is answered 200:
    taken for a replay's, it never grew the limit, which a slow spell had cut to its floor
    while the traffic was mostly texts answered from the cache (review of admission)."""
    adaptive = limit(initial=4)
    adaptive.try_acquire()

    async def route(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        created(Request(scope))
        await send({"type": "http.response.start", "status": status, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = SubmissionAdmission(route, limit=adaptive, guarded=[("POST", "/v1/scores")])
    await middleware(SUBMISSION, receive, statuses_into([]))
    assert adaptive.limit == (5 if grows else 4)


def test_a_slow_refusal_still_cuts_the_limit() -> None:
    adaptive = limit(initial=10)
    fill(adaptive)
    adaptive.release(took_s=TARGET_S * 2, accepted=False)
    assert adaptive.limit == 10 * BACKOFF


@pytest.mark.parametrize(("tasks", "cut"), [(1, True), (10, False)])
async def test_a_batch_is_timed_per_task_it_takes_on(tasks: int, cut: bool) -> None:
    """A batch of many items takes longer than one text: timed whole, each large batch cut
    every tenant's limit."""
    clock = Clock()
    adaptive = limit(initial=10, clock=clock)

    async def batch_route(scope: Scope, receive: Receive, send: Send) -> None:
        await receive()
        weigh(Request(scope), tasks)
        clock.now += TARGET_S * 3  # three times the target in all
        await send({"type": "http.response.start", "status": 202, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    middleware = SubmissionAdmission(
        batch_route, limit=adaptive, guarded=[("POST", "/v1/batches")], clock=clock
    )
    await middleware({**SUBMISSION, "path": "/v1/batches"}, receive, statuses_into([]))
    assert adaptive.limit == (10 * BACKOFF if cut else 10)


def test_a_slow_batch_never_grows_the_limit() -> None:
    """Quick per item, a batch slow as a whole grew the limit: ten batches each taking 30
    times the target moved it from 10 to 14 (a review). It grows only when quick whole."""
    adaptive = limit(initial=10)
    fill(adaptive)
    adaptive.release(took_s=TARGET_S * 30, accepted=True, tasks=1000)
    assert adaptive.limit == 10
    adaptive.release(took_s=TARGET_S / 4, accepted=True, tasks=1000)
    assert adaptive.limit == 11
