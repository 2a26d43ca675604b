"""The live-update registry and the reads that wait on it, with fakes (no broker, no HTTP)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Coroutine
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import httpx
import pytest
from fastapi import Depends, FastAPI
from pymongo.errors import AutoReconnect, OperationFailure, PyMongoError

from services.gateway.api import GatewayDeps
from services.gateway.auth import Caller
from services.gateway.errors import DatabaseUnavailable, StatusUnavailable
from services.gateway.events_api import (
    _bind_if_unbound,
    _changes_after,
    _come_back_later,
    _stream,
    event_routes,
)
from services.gateway.push import (
    BIND_RETRY_S,
    RECENT_TASKS,
    HistoryPolicy,
    HistorySource,
    LiveUpdates,
    Waiter,
    WaiterLimitReached,
    history_settled,
    listen_within,
    read_history,
    read_settled,
    read_when_changed,
)
from services.gateway.settings import GatewaySettings
from services.gateway.submissions import SubmissionState
from shared.contracts import (
    CACHED_COMPLETION_SEQUENCE,
    Phase,
    ScoreResult,
    StateChange,
    TaskAccepted,
    TaskCompleted,
    TaskEvent,
    TaskHistory,
    TaskStarted,
    TaskStatus,
    TaskView,
    event_sequence,
    utcnow,
)
from shared.http import Problem, install_problem_handlers
from tests.support import eventually

T0 = datetime(2030, 5, 17, 12, 0, 0, tzinfo=UTC)


def _started(task_id: str = "t1", tenant_id: str = "a", attempt: int = 1) -> TaskStarted:
    return TaskStarted(
        task_id=task_id,
        tenant_id=tenant_id,
        attempt=attempt,
        sequence=event_sequence(generation=0, attempt=attempt, phase=Phase.STARTED),
        submitted_at=T0,
        occurred_at=T0 + timedelta(seconds=1),
    )


def _completed(task_id: str = "t1", tenant_id: str = "a") -> TaskCompleted:
    return TaskCompleted(
        task_id=task_id,
        tenant_id=tenant_id,
        attempt=1,
        sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
        submitted_at=T0,
        occurred_at=T0 + timedelta(seconds=2),
        result=ScoreResult(score=7, comment="ok", model="m"),
    )


def _view(status: TaskStatus, sequence: int | None, task_id: str = "t1") -> TaskView:
    return TaskView(
        task_id=task_id,
        status=status,
        attempts=0,
        created_at=T0,
        updated_at=T0,
        sequence=sequence,
    )


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


# --- The registry --------------------------------------------------------------------------------


async def test_events_reach_the_waiters_of_their_task_and_tenant_only() -> None:
    live = LiveUpdates()
    mine = live.open("t1", "a")
    other_task = live.open("t2", "a")
    other_tenant = live.open("t1", "b")
    event = _started("t1", "a")
    assert live.deliver(event) == 1
    assert (await mine.next(1)) is event
    assert await other_task.next(0) is None
    assert await other_tenant.next(0) is None


async def test_a_waiter_without_events_times_out_with_none() -> None:
    live = LiveUpdates()
    with live.waiting("t1", "a") as waiter:
        assert await waiter.next(0.01) is None
        assert await waiter.next(0) is None


def test_waiters_are_bounded_per_replica_and_per_tenant() -> None:
    live = LiveUpdates(max_waiters=3, max_per_tenant=2)
    first = live.open("t1", "a")
    live.open("t2", "a")
    with pytest.raises(WaiterLimitReached) as tenant_full:
        live.open("t3", "a")
    assert tenant_full.value.per_tenant is True
    live.open("t3", "b")
    with pytest.raises(WaiterLimitReached) as replica_full:
        live.open("t4", "c")
    assert replica_full.value.per_tenant is False
    live.close(first)
    live.close(first)  # twice is harmless
    assert len(live) == 2
    live.open("t5", "a")  # the freed place is usable again
    assert len(live) == 3


def test_closing_the_last_waiter_forgets_the_task_and_tenant() -> None:
    live = LiveUpdates(max_per_tenant=1)
    with live.waiting("t1", "a"):
        assert len(live) == 1
    assert len(live) == 0
    assert live.deliver(_started("t1", "a")) == 0
    with live.waiting("t2", "a"):  # the tenant's one place is free again
        pass


async def test_an_overflowing_waiter_drops_events_and_says_so() -> None:
    live = LiveUpdates(queue_size=2)
    waiter = live.open("t1", "a")
    for attempt in range(1, 4):
        live.deliver(_started(attempt=attempt))
    assert waiter.missed
    assert [(await waiter.next(1)).attempt for _ in range(2)] == [1, 2]  # type: ignore[union-attr]


async def test_a_new_waiter_starts_with_its_tasks_recent_events() -> None:
    clock = FakeClock()
    live = LiveUpdates(recent_s=30, monotonic=clock)
    started, completed = _started("t1", "a"), _completed("t1", "a")
    live.deliver(started)
    live.deliver(_started("t2", "a"))
    live.deliver(_started("t1", "b"))
    clock.now += 10
    live.deliver(completed)
    waiter = live.open("t1", "a")
    assert await waiter.next(1) is started
    assert await waiter.next(1) is completed
    assert await waiter.next(0) is None

    clock.now += 25  # the start is now 35 s old, the completion 25 s
    late = live.open("t1", "a")
    assert await late.next(1) is completed
    assert await late.next(0) is None


def test_the_memory_of_recent_events_keeps_no_client_payload() -> None:
    """Whole acceptances were kept, the client's metadata and rubric included: 4,096 of them
    held hundreds of MiB whether or not anyone waited."""
    live = LiveUpdates()
    live.deliver(
        _accepted().model_copy(
            update={
                "metadata": {"notes": "x" * 8_000},
                "rubric": "r" * 4_000,
                "callback_url": "https://client.example/hook",
            }
        )
    )
    remembered = live.open("t1", "a")._events.get_nowait()  # what was kept
    assert isinstance(remembered, TaskAccepted)
    assert (remembered.metadata, remembered.rubric, remembered.callback_url) == ({}, None, None)
    assert StateChange.of_event(remembered) == StateChange.of_event(_accepted())


def test_the_memory_of_recent_events_forgets_what_is_older_than_its_window() -> None:
    """Entries left only when newer tasks pushed them out, however old."""
    clock = FakeClock()
    live = LiveUpdates(recent_s=30, monotonic=clock)
    for n in range(100):
        live.deliver(_started(f"old{n}", "a"))
    clock.now += 31
    live.deliver(_started("new", "a"))
    assert list(live._recent) == ["new"]  # the memory itself
    assert RECENT_TASKS > 101  # so that the age, not the count, forgot them
    clock.now += 31  # no event since: a new waiter forgets too
    live.close(live.open("t9", "a"))
    assert list(live._recent) == []


# --- Reads that wait -----------------------------------------------------------------------------


class Views:
    """A status reader whose answer the test changes."""

    def __init__(self, *views: TaskView | None) -> None:
        self.views = list(views)
        self.reads = 0

    async def __call__(self) -> TaskView | None:
        self.reads += 1
        return self.views[0] if len(self.views) == 1 else self.views.pop(0)


async def test_a_finished_task_is_answered_at_once() -> None:
    live = LiveUpdates()
    views = Views(_view(TaskStatus.COMPLETED, 190))
    view = await read_when_changed(
        views,
        live=live,
        task_id="t1",
        tenant_id="a",
        wait_s=60,
        known_status=None,
        settle_s=0,
        clock=utcnow,
    )
    assert view is not None
    assert view.status is TaskStatus.COMPLETED
    assert len(live) == 0


async def test_a_status_other_than_the_clients_is_answered_at_once() -> None:
    views = Views(_view(TaskStatus.PROCESSING, 110))
    view = await read_when_changed(
        views,
        live=LiveUpdates(),
        task_id="t1",
        tenant_id="a",
        wait_s=60,
        known_status=TaskStatus.QUEUED,
        settle_s=0,
        clock=utcnow,
    )
    assert view is not None
    assert view.status is TaskStatus.PROCESSING
    assert views.reads == 1


async def _long_poll_waiting(
    views: Views,
    live: LiveUpdates,
    *,
    known_status: TaskStatus,
    settle_s: float,
    wait_s: float = 60,
    clock: Callable[[], datetime] = utcnow,
) -> asyncio.Task[TaskView | None]:
    """A long-poll of task t1 (60 s by default), once it waits for the task's next change."""
    waiting = asyncio.create_task(
        read_when_changed(
            views,
            live=live,
            task_id="t1",
            tenant_id="a",
            wait_s=wait_s,
            known_status=known_status,
            settle_s=settle_s,
            clock=clock,
        )
    )

    async def registered() -> bool:
        return len(live) == 1

    await eventually(registered, what="the long-poll waiting")
    return waiting


async def test_the_next_change_answers_a_long_poll_with_the_settled_view() -> None:
    live = LiveUpdates()
    views = Views(_view(TaskStatus.QUEUED, 0))
    waiting = await _long_poll_waiting(views, live, known_status=TaskStatus.QUEUED, settle_s=5)
    # The status service lags the event once, then reflects it.
    views.views = [_view(TaskStatus.QUEUED, 0), _view(TaskStatus.PROCESSING, 110)]
    live.deliver(_started())
    view = await asyncio.wait_for(waiting, 5)
    assert view is not None
    assert view.status is TaskStatus.PROCESSING
    assert len(live) == 0


class FailingAfterFirst(Views):
    """A status reader whose first read answers and every later one finds it away."""

    async def __call__(self) -> TaskView | None:
        if self.reads:
            self.reads += 1
            raise StatusUnavailable("a blip")
        return await super().__call__()


async def test_a_status_service_away_after_the_first_read_answers_the_view_held() -> None:
    """One failed read past the first was a 503 for a client that had waited, at the moment
    of its change (a full pool as one event woke many waiters; found in review). The wait
    goes on, and its end answers the view held."""
    live = LiveUpdates()
    views = FailingAfterFirst(_view(TaskStatus.QUEUED, 0))
    waiting = await _long_poll_waiting(
        views, live, known_status=TaskStatus.QUEUED, settle_s=0.2, wait_s=1
    )

    live.deliver(_started())
    view = await asyncio.wait_for(waiting, 10)

    assert view == _view(TaskStatus.QUEUED, 0)
    assert views.reads >= 2


async def test_a_status_service_away_at_the_first_read_is_the_callers_to_answer() -> None:
    views = FailingAfterFirst(_view(TaskStatus.QUEUED, 0))
    views.reads = 1  # fails from the first read on
    with pytest.raises(StatusUnavailable):
        await read_when_changed(
            views,
            live=LiveUpdates(),
            task_id="t1",
            tenant_id="a",
            wait_s=1,
            known_status=None,
            settle_s=0,
            clock=utcnow,
        )


async def test_a_long_poll_ignores_events_its_view_already_reflects() -> None:
    live = LiveUpdates()
    live.deliver(_started())  # heard just before the request: remembered, but not news
    views = Views(_view(TaskStatus.PROCESSING, 110))
    view = await read_when_changed(
        views,
        live=live,
        task_id="t1",
        tenant_id="a",
        wait_s=0.05,
        known_status=None,
        settle_s=0,
        clock=utcnow,
    )
    assert view is not None
    assert view.status is TaskStatus.PROCESSING
    assert views.reads == 2  # the first read, and the one after the wait ran out


async def test_an_acceptance_that_shows_what_the_gateways_record_did_is_not_a_change() -> None:
    """A scheduled task read from the gateway's own record (no sequence) was answered at once
    by its `task.accepted`, though its status was the one the client had."""
    live = LiveUpdates()
    accepted = TaskAccepted(task_id="t1", tenant_id="a", sequence=0, submitted_at=T0)
    views = Views(_view(TaskStatus.SCHEDULED, None), _view(TaskStatus.SCHEDULED, 0))
    waiting = await _long_poll_waiting(views, live, known_status=TaskStatus.SCHEDULED, settle_s=0)
    live.deliver(accepted)
    await eventually(lambda: _at_least(views, 2), what="the acceptance read")
    assert not waiting.done()  # still waiting: nothing the client can see changed

    views.views = [_view(TaskStatus.QUEUED, 40)]
    live.deliver(TaskAccepted(task_id="t1", tenant_id="a", sequence=40, submitted_at=T0))
    view = await asyncio.wait_for(waiting, 5)
    assert view is not None
    assert view.status is TaskStatus.QUEUED


async def _at_least(views: Views | Stalling, reads: int) -> bool:
    return views.reads >= reads


async def test_a_change_the_status_service_has_not_recorded_does_not_answer_a_long_poll() -> None:
    """A change heard live whose view the status service had not updated within `settle_s`
    answered the long-poll with that stale view, at once: the status the client passed, so
    its next long-poll waited on past the change it had been woken for."""
    live = LiveUpdates()
    views = Views(_view(TaskStatus.QUEUED, 0))
    waiting = await _long_poll_waiting(views, live, known_status=TaskStatus.QUEUED, settle_s=0)
    live.deliver(_started())  # heard live; the status service still shows the task queued
    await eventually(lambda: _at_least(views, 2), what="the settling read")
    assert not waiting.done()  # still waiting: the client would see nothing new

    views.views = [_view(TaskStatus.COMPLETED, _completed().sequence)]
    live.deliver(_completed())
    view = await asyncio.wait_for(waiting, 5)
    assert view is not None
    assert view.status is TaskStatus.COMPLETED


async def test_a_long_poll_reads_again_for_a_change_heard_live_until_it_is_recorded() -> None:
    """The task's end is heard live and no event follows it: once the status service records
    it, the long-poll answers with it, without another event and before its deadline."""
    live = LiveUpdates()
    views = Views(_view(TaskStatus.QUEUED, 0))
    waiting = await _long_poll_waiting(views, live, known_status=TaskStatus.QUEUED, settle_s=0)
    live.deliver(_completed())
    await eventually(lambda: _at_least(views, 3), what="a read again for the heard change")
    assert not waiting.done()

    views.views = [_view(TaskStatus.COMPLETED, _completed().sequence)]
    view = await asyncio.wait_for(waiting, 30)  # a hang guard: the long-poll waits 60 s
    assert view is not None
    assert view.status is TaskStatus.COMPLETED


def _scheduled(not_before: datetime, sequence: int = 0) -> TaskView:
    return _view(TaskStatus.SCHEDULED, sequence).model_copy(update={"not_before": not_before})


async def test_a_scheduled_task_coming_due_answers_a_long_poll_without_an_event() -> None:
    """Its status turns `queued` as the status service reads it once `not_before` passes, and
    no event says so: the long-poll waited for the task's next event (its end) or its deadline.
    The first read at the due time still shows it scheduled (clocks apart): it reads again."""
    live = LiveUpdates()
    due = datetime.now(UTC) + timedelta(seconds=0.2)
    views = Views(_scheduled(due), _scheduled(due), _view(TaskStatus.QUEUED, 0))
    waiting = await _long_poll_waiting(views, live, known_status=TaskStatus.SCHEDULED, settle_s=0)
    view = await asyncio.wait_for(waiting, 30)  # a hang guard: the long-poll waits 60 s
    assert view is not None
    assert view.status is TaskStatus.QUEUED
    assert views.reads == 3
    assert len(live) == 0


async def test_a_scheduled_task_comes_due_by_the_services_clock() -> None:
    """The gateway's clock (the database's, as the status service's, which turns the task
    `queued`) reads an hour ahead of this machine's, where the task is not due for another
    hour yet: the long-poll reads again at once, not in an hour."""
    live = LiveUpdates()
    ahead = timedelta(hours=1)
    due = utcnow() + ahead
    views = Views(_scheduled(due), _scheduled(due), _view(TaskStatus.QUEUED, 0))
    waiting = await _long_poll_waiting(
        views,
        live,
        known_status=TaskStatus.SCHEDULED,
        settle_s=0,
        clock=lambda: utcnow() + ahead,
    )
    view = await asyncio.wait_for(waiting, 30)  # a hang guard: the long-poll waits 60 s
    assert view is not None
    assert view.status is TaskStatus.QUEUED
    assert views.reads == 3


class Stalling:
    """A status reader that gives its views, then never answers again (a status service that
    hangs)."""

    def __init__(self, *views: TaskView) -> None:
        self.views = list(views)
        self.reads = 0
        self.never = asyncio.Event()

    async def __call__(self) -> TaskView | None:
        self.reads += 1
        if self.views:
            return self.views.pop(0)
        await self.never.wait()
        raise AssertionError("never answered")


@pytest.mark.parametrize("heard", [False, True], ids=["last-read", "settling-read"])
async def test_a_long_poll_ends_with_the_view_it_holds_when_a_read_outlasts_its_wait(
    heard: bool,
) -> None:
    """The read at a long-poll's deadline, and a settling read started just before it, were
    not bounded by the deadline: `wait=60` took as long as a slow status service made it."""
    live = LiveUpdates()
    if heard:
        live.deliver(_started())  # heard just before: the long-poll settles it, and hangs
    views = Stalling(_view(TaskStatus.QUEUED, 0))
    async with asyncio.timeout(30):  # a hang guard only: the second read never answers
        view = await read_when_changed(
            views,
            live=live,
            task_id="t1",
            tenant_id="a",
            wait_s=0.05,
            known_status=TaskStatus.QUEUED,
            settle_s=5,
            clock=utcnow,
        )
    assert view == _view(TaskStatus.QUEUED, 0)
    assert views.reads == 2
    assert len(live) == 0


async def test_read_settled_gives_up_after_settle_s_with_what_it_has() -> None:
    views = Views(_view(TaskStatus.QUEUED, 0))
    view = await read_settled(views, _started(), settle_s=0)
    assert view is not None
    assert view.sequence == 0


class Histories:
    def __init__(self, *histories: TaskHistory | None) -> None:
        self.histories = list(histories)
        self.afters: list[int] = []

    async def __call__(self, after: int) -> TaskHistory | None:
        self.afters.append(after)
        history = self.histories[0] if len(self.histories) == 1 else self.histories.pop(0)
        if history is None:
            return None
        changes = [change for change in history.changes if change.sequence > after]
        return history.model_copy(update={"changes": changes})


def _history(*events: TaskEvent) -> TaskHistory:
    changes = [StateChange.of_event(event) for event in events]
    return TaskHistory(
        task_id="t1", status=changes[-1].status, sequence=changes[-1].sequence, changes=changes
    )


def _accepted() -> TaskAccepted:
    return TaskAccepted(task_id="t1", tenant_id="a", sequence=0, submitted_at=T0, occurred_at=T0)


async def test_history_settled_waits_for_the_event_and_returns_what_was_missed() -> None:
    histories = Histories(
        _history(_accepted()),
        _history(_accepted(), _started(), _completed()),
    )
    settled = await history_settled(histories, after=0, event=_completed(), settle_s=5)
    statuses = [change.status for change in settled.changes]
    assert statuses == [TaskStatus.PROCESSING, TaskStatus.COMPLETED]
    assert settled.recorded == _completed().sequence
    assert histories.afters == [0, 0]


async def test_history_settled_adds_the_event_when_the_status_service_lags() -> None:
    histories = Histories(_history(_accepted()))
    settled = await history_settled(histories, after=0, event=_completed(), settle_s=0)
    assert [change.sequence for change in settled.changes] == [_completed().sequence]
    assert settled.changes[0].result is not None
    assert settled.recorded == 0  # heard live only: a stream gives it no id


async def test_settling_reads_back_off_while_the_status_service_lags() -> None:
    """Every waiter re-read the status service every 20 ms for the whole settle window while
    it lagged (~100 reads per event and waiter over 2 s, on a service lagging because it was
    loaded); the reads now back off, and still end with one at the deadline."""
    views = Views(_view(TaskStatus.QUEUED, 0))
    histories = Histories(_history(_accepted()))
    view, settled = await asyncio.gather(
        read_settled(views, _completed(), settle_s=2),
        history_settled(histories, after=0, event=_completed(), settle_s=2),
    )
    assert view is not None
    assert view.sequence == 0  # never caught up: what it had
    assert [change.sequence for change in settled.changes] == [_completed().sequence]
    assert 2 <= views.reads <= 15
    assert 2 <= len(histories.afters) <= 15


class StuckBinding:
    """A bind that waits for `done`, then fails while `failing` (the broker away)."""

    def __init__(self) -> None:
        self.calls = 0
        self.done = asyncio.Event()
        self.failing = True

    async def bind(self) -> None:
        self.calls += 1
        await self.done.wait()
        if self.failing:
            raise ConnectionError("the broker is away")

    async def unbind(self) -> None:
        pass


async def test_long_polls_arriving_together_share_one_bind_and_keep_their_deadlines() -> None:
    """Each waiter bound in turn, waiting out the bind timeout of every one before it, and a
    long-poll's wait began only after its bind: the sixth `wait=5` of a burst answered after
    a minute while the broker was away."""
    clock, binding = FakeClock(), StuckBinding()
    live = LiveUpdates(binding=binding, monotonic=clock)

    async def read() -> TaskView:
        return _view(TaskStatus.QUEUED, 0)

    async def long_poll(task_id: str) -> TaskView | None:
        return await read_when_changed(
            read,
            live=live,
            task_id=task_id,
            tenant_id="a",
            wait_s=0.05,
            known_status=None,
            settle_s=0,
            clock=utcnow,
        )

    async with asyncio.timeout(30):  # a hang guard only: the bind never ends on its own
        views = await asyncio.gather(*(long_poll(f"t{n}") for n in range(5)))
    assert [view.status for view in views if view is not None] == [TaskStatus.QUEUED] * 5
    assert binding.calls == 1

    binding.done.set()
    await live.listen()  # the shared bind fails
    await live.listen()  # just after a failure: no bind
    assert (binding.calls, live.listening) == (1, False)
    clock.now += BIND_RETRY_S
    binding.failing = False
    await live.listen()
    assert (binding.calls, live.listening) == (2, True)
    await live.stop_listening()


async def test_a_stream_opened_while_binding_failed_binds_at_a_later_heartbeat() -> None:
    """Nothing bound the live queue after a failed bind unless another request came: a stream
    opened meanwhile heard changes only at its periodic re-read, for its whole life."""
    clock, binding = FakeClock(), StuckBinding()
    binding.done.set()
    live = LiveUpdates(binding=binding, monotonic=clock)
    await live.listen()  # the broker away: the bind fails
    waiter = live.open("t1", "a")

    await _bind_if_unbound(live)  # within the back-off: no bind tried
    assert (binding.calls, live.listening, waiter.missed) == (1, False, False)
    clock.now += BIND_RETRY_S
    binding.failing = False
    await _bind_if_unbound(live)  # a heartbeat after it: bound, and a re-read asked
    assert (binding.calls, live.listening, waiter.missed) == (2, True, True)
    await live.stop_listening()


async def _status_away(after: int) -> TaskHistory | None:
    raise StatusUnavailable("the status service is away")


async def test_history_settled_gives_the_event_when_the_status_service_is_away() -> None:
    settled = await history_settled(_status_away, after=0, event=_completed(), settle_s=0)
    assert [change.sequence for change in settled.changes] == [_completed().sequence]
    assert settled.changes[0].result is not None
    assert settled.recorded == 0


async def test_a_streams_resync_while_the_status_service_is_away_finds_nothing_new() -> None:
    """The stream goes on (heartbeats, live events) instead of ending: an EventSource whose
    reconnection is answered 503 gives up for good."""
    settled = await _changes_after(0, None, read=_status_away, settle_s=0)
    assert settled is not None
    assert settled.changes == []


async def _read_history(
    after: int, status: HistorySource, submissions: Any, now: datetime = T0 + timedelta(seconds=1)
) -> TaskHistory | None:
    """`read_history` of task t1 of tenant a, at `now`, over a 5-minute window."""
    return await read_history(
        "t1",
        tenant_id="a",
        after=after,
        status=status,
        submissions=submissions,
        clock=lambda: now,
        policy=HistoryPolicy(window=timedelta(minutes=5)),
    )


class FakeSubmissions:
    def __init__(self, submission: Any) -> None:
        self.submission = submission

    async def find(self, task_id: str, *, tenant_id: str) -> Any:
        return self.submission

    async def cached_result(self, task_id: str, *, tenant_id: str) -> ScoreResult | None:
        return None if self.submission is None else self.submission.cached_result


class NoHistory:
    async def history(self, task_id: str, *, tenant_id: str, after: int) -> TaskHistory | None:
        return None


class Submission:
    def __init__(
        self,
        created_at: datetime,
        not_before: datetime | None = None,
        cached_result: ScoreResult | None = None,
        state: SubmissionState = SubmissionState.ACCEPTED,
    ) -> None:
        self.created_at = created_at
        self.not_before = not_before
        self.cached_result = cached_result
        self.state = state
        self.sent_at: datetime | None = None
        self.generation = 0
        self.finished_generation: int | None = None


@pytest.mark.parametrize(
    ("after", "not_before", "status", "changes"),
    [
        (-1, None, TaskStatus.QUEUED, 1),
        (0, None, TaskStatus.QUEUED, 0),
        (-1, T0 + timedelta(hours=1), TaskStatus.SCHEDULED, 1),
    ],
)
async def test_a_young_submission_reads_as_its_acceptance(
    after: int, not_before: datetime | None, status: TaskStatus, changes: int
) -> None:
    history = await _read_history(after, NoHistory(), FakeSubmissions(Submission(T0, not_before)))
    assert history is not None
    assert history.status is status
    assert len(history.changes) == changes
    assert all(change.sequence == 0 for change in history.changes)


@pytest.mark.parametrize(("after", "sequences"), [(-1, [0, 90]), (0, [90]), (90, [])])
async def test_a_young_cache_hit_reads_as_accepted_and_completed(
    after: int, sequences: list[int]
) -> None:
    """A result-cache hit the status service has not heard of: its completion came with
    its answer, and a stream right after it must not wait for events already gone by."""
    result = ScoreResult(score=6.0, comment="cached", model="m", cached=True)
    history = await _read_history(
        after, NoHistory(), FakeSubmissions(Submission(T0, cached_result=result))
    )
    assert history is not None
    assert (history.status, history.sequence) == (TaskStatus.COMPLETED, 90)
    assert [change.sequence for change in history.changes] == sequences
    assert all(c.result == result for c in history.changes if c.status is TaskStatus.COMPLETED)


class AcceptedOnlyHistory:
    """The status service's history of a task of which it has applied only the acceptance."""

    async def history(self, task_id: str, *, tenant_id: str, after: int) -> TaskHistory | None:
        history = _history(_accepted())
        changes = [change for change in history.changes if change.sequence > after]
        return history.model_copy(update={"changes": changes})


CACHED = ScoreResult(score=6.0, comment="cached", model="m", cached=True)


async def test_a_cache_hit_read_after_its_completion_is_completed_while_the_status_lags() -> None:
    """A client saw the cache hit's completion (90) from the submission; the status service
    has since applied the acceptance alone: reading after 90 is the completion again."""
    history = await _read_history(
        CACHED_COMPLETION_SEQUENCE,
        AcceptedOnlyHistory(),
        FakeSubmissions(Submission(T0, cached_result=CACHED)),
    )
    assert history is not None
    assert (history.status, history.sequence, history.changes) == (
        TaskStatus.COMPLETED,
        CACHED_COMPLETION_SEQUENCE,
        [],
    )


class CountedSubmissions(FakeSubmissions):
    """Counts its reads (each one a MongoDB find in production)."""

    def __init__(self, submission: Any) -> None:
        super().__init__(submission)
        self.finds = 0

    async def find(self, task_id: str, *, tenant_id: str) -> Any:
        self.finds += 1
        return await super().find(task_id, tenant_id=tenant_id)

    async def cached_result(self, task_id: str, *, tenant_id: str) -> ScoreResult | None:
        self.finds += 1
        return await super().cached_result(task_id, tenant_id=tenant_id)


async def test_settling_a_live_event_while_the_status_lags_reads_no_submission() -> None:
    """A stream showed `task.started` live without an id, and the completion arrives while
    the status service has applied only the acceptance: settling re-reads the history about
    a dozen times, and none of them is the cache hit's case (found in review: each read
    also read the submission)."""
    submissions = CountedSubmissions(Submission(T0))

    async def read(since: int) -> TaskHistory | None:
        return await _read_history(since, AcceptedOnlyHistory(), submissions)

    settled = await history_settled(
        read, after=_started().sequence, event=_completed(), settle_s=0.5
    )
    assert [change.sequence for change in settled.changes] == [_completed().sequence]
    assert submissions.finds == 0


async def test_an_eventsource_reconnecting_after_a_cache_hits_completion_is_told_it_ended() -> None:
    """It was a 400 (`Last-Event-ID` ahead of the history), an error to the client of a task
    that completed; a 204 tells an `EventSource` the stream is over."""
    live = LiveUpdates()
    submissions = FakeSubmissions(Submission(T0, cached_result=CACHED))
    async with _stream_client(live, AcceptedOnlyHistory(), submissions) as client:
        headers = {"Accept": "text/event-stream", "Last-Event-ID": "90"}
        answer = await client.get("/v1/scores/t1/events", headers=headers)
    assert answer.status_code == 204, answer.text
    assert len(live) == 0


async def test_a_last_event_id_ahead_of_a_task_without_a_cache_hit_is_still_refused() -> None:
    live = LiveUpdates()
    async with _stream_client(live, AcceptedOnlyHistory(), FakeSubmissions(None)) as client:
        headers = {"Accept": "text/event-stream", "Last-Event-ID": "90"}
        answer = await client.get("/v1/scores/t1/events", headers=headers)
    assert answer.status_code == 400, answer.text
    assert answer.headers["content-type"] == "application/problem+json"


async def test_a_first_look_at_an_old_acceptance_reads_no_submission() -> None:
    """Past the read-your-writes window, a cache hit's completion was announced again long
    since: the stream's first read read the whole submission, and a database away refused
    it (found in review), while a poll answered from the status service."""
    submissions = CountedSubmissions(Submission(T0, cached_result=CACHED))
    history = await _read_history(
        -1, AcceptedOnlyHistory(), submissions, now=T0 + timedelta(hours=1)
    )
    assert history is not None
    assert (history.status, history.sequence) == (TaskStatus.QUEUED, 0)
    assert submissions.finds == 0


async def test_a_first_look_at_a_young_acceptance_shows_the_cache_hits_completion() -> None:
    history = await _read_history(
        -1, AcceptedOnlyHistory(), FakeSubmissions(Submission(T0, cached_result=CACHED))
    )
    assert history is not None
    assert [(c.sequence, c.occurred_at) for c in history.changes] == [
        (0, T0),
        (CACHED_COMPLETION_SEQUENCE, T0),  # dated as its acceptance, as its publish is
    ]
    assert history.changes[-1].result == CACHED


async def test_a_first_look_at_a_young_acceptance_with_the_database_away_is_the_history() -> None:
    """As a poll answers then: the status service's view (a new stream was refused: 503,
    or a `retry:`-only stream for the whole outage)."""
    away = FailingSubmissions(AutoReconnect("connection reset"))
    history = await _read_history(-1, AcceptedOnlyHistory(), away)
    assert history is not None
    assert (history.status, [c.sequence for c in history.changes]) == (TaskStatus.QUEUED, [0])


@pytest.mark.parametrize("state", [SubmissionState.UNCONFIRMED, SubmissionState.ACCEPTING])
async def test_an_old_submission_not_yet_sent_reads_as_queued(state: SubmissionState) -> None:
    """Left unsent past the read-your-writes window (a broker alarm of longer), it read as
    404 "expired", and a client resubmitting had its text scored twice."""
    history = await _read_history(
        -1, NoHistory(), FakeSubmissions(Submission(T0, state=state)), now=T0 + timedelta(hours=1)
    )
    assert history is not None
    assert history.status is TaskStatus.QUEUED


async def test_an_old_unknown_submission_reads_as_unknown() -> None:
    history = await _read_history(
        -1, NoHistory(), FakeSubmissions(Submission(T0)), now=T0 + timedelta(hours=1)
    )
    assert history is None


# --- The stream's route --------------------------------------------------------------------------


class ThreadRecordingLive(LiveUpdates):
    """Records the thread of every `close`: the registry is not thread-safe."""

    def __init__(self) -> None:
        super().__init__()
        self.closed_on: list[int] = []

    def close(self, waiter: Waiter) -> None:
        self.closed_on.append(threading.get_ident())
        super().close(waiter)


class FinishedTaskHistory:
    """The status service's history of a finished task."""

    async def history(self, task_id: str, *, tenant_id: str, after: int) -> TaskHistory | None:
        history = _history(_accepted(), _completed())
        changes = [change for change in history.changes if change.sequence > after]
        return history.model_copy(update={"changes": changes})


def _stream_client(
    live: LiveUpdates,
    history: HistorySource | None = None,
    submissions: object = None,
    refusal: Problem | None = None,
) -> httpx.AsyncClient:
    """A client of the event routes over `live`, for `history` (by default a finished task's)
    and `submissions` (what the route reads when the status service has not heard of it);
    with `refusal`, the caller dependency in front of the route refuses every request."""
    deps = SimpleNamespace(
        settings=GatewaySettings.model_validate({}), submissions=submissions, clock=utcnow
    )

    async def caller() -> Caller:
        if refusal is not None:
            raise refusal
        return Caller(tenant_id="a", key_id="k")

    async def still_valid(_: Caller) -> bool:
        return True

    app = FastAPI()
    install_problem_handlers(app)
    source = FinishedTaskHistory() if history is None else history
    app.include_router(
        event_routes(cast(GatewayDeps, deps), live, source, Depends(caller), still_valid)
    )
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://gateway.test")


async def test_a_streams_waiter_is_closed_on_the_event_loop() -> None:
    """The response's background close was a plain function, which Starlette runs in a worker
    thread, racing the loop's `open`/`deliver` on the registry's sets and counters."""
    live = ThreadRecordingLive()
    async with _stream_client(live) as client:
        response = await client.get("/v1/scores/t1/events")
    assert response.status_code == 200
    assert "completed" in response.text
    assert live.closed_on  # the stream's own close, and the response's
    assert set(live.closed_on) == {threading.get_ident()}
    assert len(live) == 0


class LiveWithStuckBind(LiveUpdates):
    def __init__(self) -> None:
        super().__init__(binding=StuckBinding())


async def test_a_stream_opened_while_the_bind_hangs_answers_without_waiting_for_it() -> None:
    """The stream awaited the live queue's bind without a bound: with the broker away, a bind
    (and every stream waiting on it) took up to two broker timeouts before any header."""
    live = LiveWithStuckBind()
    async with _stream_client(live) as client:
        async with asyncio.timeout(20):  # a hang guard only: the bind never ends
            response = await client.get("/v1/scores/t1/events")
    assert response.status_code == 200
    assert "completed" in response.text
    assert not live.listening


class FailingSubmissions:
    """The gateway's submissions of a database that fails every read, as its store raises it:
    a `DatabaseUnavailable` whose cause is the PyMongo error."""

    def __init__(self, cause: PyMongoError) -> None:
        self.cause = cause

    async def find(self, task_id: str, *, tenant_id: str) -> Any:
        raise DatabaseUnavailable(str(self.cause)) from self.cause

    async def cached_result(self, task_id: str, *, tenant_id: str) -> ScoreResult | None:
        raise DatabaseUnavailable(str(self.cause)) from self.cause


RECONNECTION = {"Accept": "text/event-stream", "Last-Event-ID": "0"}


def _retry_ms(text: str) -> int:
    """The `retry:` of a stream holding nothing else."""
    (retry,) = [line for line in text.splitlines() if line.startswith("retry:")]
    return int(retry.removeprefix("retry:"))


@pytest.mark.parametrize(
    "cause",
    [
        OperationFailure("Document failed validation", code=121),
        OperationFailure("not authorized on scorebox to execute find", code=13),
    ],
    ids=["failed-validation", "unauthorized"],
)
async def test_an_eventsource_reconnecting_to_a_database_refusing_for_good_gets_a_500(
    cause: OperationFailure,
) -> None:
    """A refusal for good recurs on every reconnection: told to retry, an EventSource came
    back for ever; it gets the 500 `database-refused` problem, without Retry-After."""
    live = LiveUpdates()
    async with _stream_client(live, NoHistory(), FailingSubmissions(cause)) as client:
        answer = await client.get("/v1/scores/t1/events", headers=RECONNECTION)
    assert answer.status_code == 500, answer.text
    assert answer.headers["content-type"] == "application/problem+json"
    assert answer.json()["type"].endswith("/database-refused")
    assert "retry-after" not in answer.headers
    assert len(live) == 0  # its waiter closed


async def test_an_eventsource_reconnecting_to_a_database_away_is_told_to_retry() -> None:
    """An outage passes: the reconnection gets a stream holding only `retry:`, so that it
    comes back, and no event."""
    live = LiveUpdates()
    away = FailingSubmissions(AutoReconnect("connection reset"))
    async with _stream_client(live, NoHistory(), away) as client:
        answer = await client.get("/v1/scores/t1/events", headers=RECONNECTION)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.headers["retry-after"] == "5"
    assert 5000 <= _retry_ms(answer.text) <= 7500  # up to half as long again
    assert "data:" not in answer.text
    assert len(live) == 0


async def test_an_eventsource_finding_the_waiters_at_their_limit_is_told_to_retry() -> None:
    """A replica lost, its streams reconnecting to the others, fills them: a 503 (or the
    tenant's 429) made each `EventSource` turned away stop for good."""
    live = LiveUpdates(max_waiters=1)
    held = live.open("other", "b")
    async with _stream_client(live) as client:
        answer = await client.get("/v1/scores/t1/events", headers=RECONNECTION)
        plain = await client.get("/v1/scores/t1/events")
    live.close(held)
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.headers["retry-after"] == "1"
    assert 3000 <= _retry_ms(answer.text) <= 4500  # at least SSE_RETRY_MS (3 s)
    assert "data:" not in answer.text
    assert plain.status_code == 503  # a client that does not reconnect by itself
    assert plain.headers["content-type"] == "application/problem+json"


def _rate_limited() -> Problem:
    return Problem(429, "Rate limit reached.", kind="rate-limited", headers={"Retry-After": "42"})


def _key_store_away() -> Problem:
    return Problem(503, "The key store is unavailable.", headers={"Retry-After": "5"})


@pytest.mark.parametrize(
    ("refusal", "least_ms"),
    [(_rate_limited(), 42_000), (_key_store_away(), 5_000)],
    ids=["rate-limited", "key-store-away"],
)
async def test_an_eventsource_the_caller_dependency_refuses_for_now_is_told_to_retry(
    refusal: Problem, least_ms: int
) -> None:
    """The authentication in front of the route answered its 429 or 503 problem, on which an
    `EventSource` stops for good (found in review): a stream holding only `retry:`, the
    problem's Retry-After; a client that does not reconnect by itself still gets the problem."""
    live = LiveUpdates()
    async with _stream_client(live, refusal=refusal) as client:
        answer = await client.get("/v1/scores/t1/events", headers=RECONNECTION)
        plain = await client.get("/v1/scores/t1/events")
    assert answer.status_code == 200, answer.text
    assert answer.headers["content-type"].startswith("text/event-stream")
    assert answer.headers["retry-after"] == refusal.headers["Retry-After"]
    assert least_ms <= _retry_ms(answer.text) <= least_ms * 3 // 2
    assert "data:" not in answer.text
    assert plain.status_code == refusal.status
    assert plain.headers["content-type"] == "application/problem+json"


@pytest.mark.parametrize(
    "refusal",
    [
        Problem(401, "The API key is malformed, unknown or revoked.", kind="unauthorized"),
        Problem(500, "The database refused this operation for good.", kind="database-refused"),
    ],
    ids=["unauthorized", "refused-for-good"],
)
async def test_an_eventsource_the_caller_dependency_refuses_for_good_gets_the_problem(
    refusal: Problem,
) -> None:
    """A bad key, or a refusal that recurs on every reconnection: the `EventSource` should
    stop."""
    async with _stream_client(LiveUpdates(), refusal=refusal) as client:
        answer = await client.get("/v1/scores/t1/events", headers=RECONNECTION)
    assert answer.status_code == refusal.status
    assert answer.headers["content-type"] == "application/problem+json"


# --- A bind that lands after a stream's read ---------------------------------------------------


async def _authorised() -> bool:
    return True


def _open_stream(
    live: LiveUpdates,
    waiter: Waiter,
    histories: Histories,
    first: TaskHistory,
    heartbeat_s: float = 0.05,
) -> Any:
    return _stream(
        "t1",
        first,
        after=-1,
        waiter=waiter,
        read=histories,
        authorised=_authorised,
        live=live,
        heartbeat_s=heartbeat_s,
        max_stream_s=3_600,
        retry_ms=0,
        settle_s=0,
    )


async def _until_completed(stream: Any) -> bytes:
    """The stream's frames up to its end (its completion); a hang guard only."""
    frames = []
    async with asyncio.timeout(20):
        async for frame in stream:
            frames.append(frame)
    return b"".join(frames)


async def test_a_stream_unbound_at_its_read_rereads_once_another_request_binds() -> None:
    """A stream opened during the bind's back-off read the history unheard; another request
    then bound the queue, the stream's heartbeat found it listening and never re-read: what
    changed before the bind came only at the periodic re-read, a minute later."""
    clock, binding = FakeClock(), StuckBinding()
    binding.done.set()
    live = LiveUpdates(binding=binding, monotonic=clock)
    await live.listen()  # the broker away: the bind fails, its back-off begins
    waiter = live.open("t1", "a")
    histories = Histories(_history(_accepted()))
    first = await histories(-1)
    assert first is not None
    stream = _open_stream(live, waiter, histories, first)
    assert (await anext(stream)).startswith(b"retry:")
    assert b'"queued"' in await anext(stream)
    # The task completes while nothing is bound: its events reach no queue of this replica.
    histories.histories = [_history(_accepted(), _started(), _completed())]
    clock.now += BIND_RETRY_S
    binding.failing = False
    await live.listen()  # another request binds
    assert b'"completed"' in await _until_completed(stream)
    await live.stop_listening()


async def test_a_stream_whose_bind_lands_after_its_read_rereads() -> None:
    """The route waits `REBIND_WITHIN_S` for the bind, then reads; the bind lands later."""
    binding = StuckBinding()
    binding.failing = False
    live = LiveUpdates(binding=binding)
    waiter = live.open("t1", "a")
    await listen_within(live, 0.01)  # given up: the bind goes on
    histories = Histories(_history(_accepted()))
    first = await histories(-1)
    assert first is not None
    assert not live.listening
    stream = _open_stream(live, waiter, histories, first)
    await anext(stream), await anext(stream)
    histories.histories = [_history(_accepted(), _started(), _completed())]  # unheard
    binding.done.set()

    async def bound() -> bool:
        return live.listening

    await eventually(bound, what="the bind landing")
    assert b'"completed"' in await _until_completed(stream)
    await live.stop_listening()


async def test_a_stream_hearing_events_it_has_seen_still_beats() -> None:
    """Each event restarted the heartbeat's wait: a stream hearing events it skips (seen
    already: a retry's put-off told again, the outbox sweep's re-announcements) more often
    than its heartbeat sent no keep-alive and never asked after its key (review of live
    updates)."""
    live = LiveUpdates()
    waiter = live.open("t1", "a")
    histories = Histories(_history(_accepted(), _started()))
    first = await histories(-1)
    assert first is not None
    stream = _open_stream(live, waiter, histories, first, heartbeat_s=0.05)
    await anext(stream), await anext(stream), await anext(stream)  # retry, queued, started

    async def told_again() -> None:
        while True:
            waiter.offer(_started())
            await asyncio.sleep(0.005)  # the traffic itself, not a wait for a condition

    feeding = asyncio.create_task(told_again())
    try:
        async with asyncio.timeout(20):  # a hang guard only
            assert await anext(stream) == b": keep-alive\n\n"
    finally:
        feeding.cancel()
    await stream.aclose()


# --- The replica stopping ----------------------------------------------------------------------


async def test_a_stopping_replica_ends_its_streams() -> None:
    live = LiveUpdates()
    waiter = live.open("t1", "a")
    histories = Histories(_history(_accepted()))
    first = await histories(-1)
    assert first is not None
    stream = _open_stream(live, waiter, histories, first, heartbeat_s=600)
    await anext(stream), await anext(stream)
    ending = asyncio.create_task(_until_completed(stream))
    live.stop_waiting()
    assert await ending == b""  # ended, with no keep-alive or change after the stop
    assert len(live) == 0


async def test_a_stopping_replica_answers_its_long_polls_and_any_that_arrive() -> None:
    live = LiveUpdates()
    views = Views(_view(TaskStatus.QUEUED, 0))
    waiting = await _long_poll_waiting(views, live, known_status=TaskStatus.QUEUED, settle_s=5)
    live.stop_waiting()
    async with asyncio.timeout(20):  # a hang guard only: its wait is 60 s
        view = await waiting
        late = await read_when_changed(
            views,
            live=live,
            task_id="t2",
            tenant_id="a",
            wait_s=60,
            known_status=TaskStatus.QUEUED,
            settle_s=5,
            clock=utcnow,
        )
    assert view is not None
    assert late is not None
    assert (view.status, late.status) == (TaskStatus.QUEUED, TaskStatus.QUEUED)
    assert len(live) == 0


@pytest.mark.parametrize(
    ("retry_after", "least_ms", "most_ms"),
    [
        ("Wed, 21 Oct 2015 07:28:00 GMT", 3_000, 4_500),  # a date: the least
        ("nan", 3_000, 4_500),
        ("86400", 60_000, 60_000),  # a day: a minute, the most
        ("10", 10_000, 15_000),
    ],
)
def test_the_retry_of_a_refusal_is_bounded_whatever_its_retry_after(
    retry_after: str, least_ms: int, most_ms: int
) -> None:
    """`int(float(...))` of an HTTP date or `nan` raised (a 500 to an EventSource, which
    stops for good), and a day's Retry-After left it silent for that long (a review)."""
    problem = Problem(503, "away", kind="unavailable", headers={"Retry-After": retry_after})
    answer = _come_back_later(problem, min_retry_ms=3_000)
    assert least_ms <= _retry_ms(bytes(answer.body).decode()) <= most_ms


def _an_hours_long_poll(views: Views, live: LiveUpdates) -> Coroutine[Any, Any, TaskView | None]:
    """A long-poll of task t1 by a client that has it `queued`, waiting up to an hour."""
    return read_when_changed(
        views,
        live=live,
        task_id="t1",
        tenant_id="a",
        wait_s=3600,
        known_status=TaskStatus.QUEUED,
        settle_s=0,
        clock=utcnow,
    )


async def test_a_finished_tasks_long_poll_is_answered_while_the_bind_hangs() -> None:
    """The long-poll waited for the live queue's bind before its first read: with the broker
    away, a finished task's long-poll waited a whole bind attempt (`BROKER_TIMEOUT_S`) for
    what a plain poll answered at once (a review)."""
    binding = StuckBinding()
    live = LiveUpdates(binding=binding)
    views = Views(_view(TaskStatus.COMPLETED, 190))
    async with asyncio.timeout(20):  # a hang guard only: the bind never ends on its own
        view = await _an_hours_long_poll(views, live)
    assert view is not None
    assert view.status is TaskStatus.COMPLETED
    assert (views.reads, len(live), live.listening) == (1, 0, False)
    binding.done.set()
    await live.stop_listening()


async def test_a_long_poll_reads_again_at_once_when_its_events_may_have_been_lost() -> None:
    """The live queue's connection lost and restored: an event published meanwhile reached
    no queue of this replica, and the long-poll answered it only at its deadline (review of
    live updates). Told (`note_restored`), it reads again at once."""
    live = LiveUpdates()
    views = Views(_view(TaskStatus.QUEUED, 0))
    waiting = asyncio.create_task(_an_hours_long_poll(views, live))

    async def first_read_done() -> bool:
        return views.reads == 1 and len(live) == 1

    await eventually(first_read_done, what="the long-poll waiting")
    live.note_restored()  # nothing was lost: it reads again, and waits on

    async def read_again() -> bool:
        return views.reads == 2

    await eventually(read_again, what="the long-poll reading again")
    assert not waiting.done()
    views.views = [_view(TaskStatus.COMPLETED, 190)]  # its event lost
    live.note_restored()
    async with asyncio.timeout(20):  # a hang guard only: no event comes
        view = await waiting
    assert view is not None
    assert view.status is TaskStatus.COMPLETED


async def test_the_waiters_told_of_a_restored_connection_reread_spread_out() -> None:
    """All at once, a replica's thousands of waiters read the status service together as
    it came back from the broker's restart too (re-read)."""
    live = LiveUpdates()
    waiters = [live.open(f"t{i}", "a") for i in range(100)]
    live.note_restored()
    assert sum(waiter.missed for waiter in waiters) < len(waiters)

    async def every_one_told() -> bool:
        return all(waiter.missed for waiter in waiters)

    await eventually(every_one_told, what="every waiter nudged")


async def test_a_waiter_nudged_twice_before_it_reads_wakes_once() -> None:
    """Each nudge a wake-up of its own: a long-poll took the second for its deadline and
    answered its unchanged view early."""
    waiter = Waiter("t1", "a")
    waiter.nudge()
    waiter.nudge()
    waiter.offer(_started())
    assert await waiter.next(1) is None
    assert waiter.missed
    assert await waiter.next(1) is not None


class StuckUnbinding:
    """A binding whose removal waits for `done` (a stalled broker)."""

    def __init__(self) -> None:
        self.done = asyncio.Event()

    async def bind(self) -> None:
        pass

    async def unbind(self) -> None:
        await self.done.wait()


async def test_a_finished_tasks_long_poll_is_answered_while_the_unbinding_hangs() -> None:
    """While nobody waited, the binding was being removed over a stalled broker: a finished
    task's long-poll waited for the removal, then for a bind, up to 20 s, for what a plain
    poll answered at once (review of live updates)."""
    binding = StuckUnbinding()
    live = LiveUpdates(binding=binding, linger_s=0.01)
    await live.listen()

    async def unbinding() -> bool:
        return live.listening and not live.bound

    await eventually(unbinding, what="the binding being removed")
    views = Views(_view(TaskStatus.COMPLETED, 190))
    async with asyncio.timeout(20):  # a hang guard only: the removal never ends on its own
        view = await _an_hours_long_poll(views, live)
    assert view is not None
    assert view.status is TaskStatus.COMPLETED
    assert views.reads == 1
    binding.done.set()
    await live.stop_listening()


async def test_a_long_poll_reads_again_once_a_bind_it_read_before_has_ended() -> None:
    """Read while the bind was under way, the view may miss a change published before the
    bind reached the broker, which no event will tell: once bound, the long-poll reads again
    and answers the change it finds."""
    binding = StuckBinding()
    binding.failing = False
    live = LiveUpdates(binding=binding)
    views = Views(_view(TaskStatus.QUEUED, 0))
    waiting = asyncio.create_task(_an_hours_long_poll(views, live))

    async def read_once() -> bool:
        return views.reads == 1

    await eventually(read_once, what="the first read, the bind under way")
    views.views = [_view(TaskStatus.COMPLETED, 190)]  # finished before the bind, unheard
    binding.done.set()
    async with asyncio.timeout(20):  # a hang guard only: no event comes
        view = await waiting
    assert view is not None
    assert view.status is TaskStatus.COMPLETED
    assert views.reads == 2
    await live.stop_listening()
