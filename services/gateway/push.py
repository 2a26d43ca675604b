"""Live updates: every gateway replica hears every task event and wakes the requests waiting
on that task (`GET /v1/scores/{id}/events` streams and `?wait=` long-polls).

    scorebox.events --task.*--> scorebox.live.<replica> --> LiveUpdates --> Waiter (per request)

The broker queue is the replica's own (exclusive, auto-delete; see `shared.topology`), so a
live event is a wake-up call, not the record: what a request answers still comes from the
status service, which may lag the event by a few milliseconds; `read_settled` and
`history_settled` retry a read (bounded) until it reflects the event, backing off between
reads: every 20 ms for the whole `LIVE_SETTLE_S` was ~100 reads per event per waiter, which
multiplied the load on a status service that lagged because it was loaded. A lost live event (a
broker reconnect, an overflowing waiter) therefore costs latency, never correctness: streams
re-read the history periodically and whenever their waiter overflowed.

The race the other way round — the replica hears an event just before a request starts
waiting, and the status service has not applied it yet when the request reads — is closed by
a small memory of recent events: a new waiter starts with its task's events of the last few
seconds, and ignores those its first read already reflects.

The queue is bound to `scorebox.events` only while requests wait (`LiveBinding`): the first
waiter binds it before its first read, and it is unbound once no request has waited for
`LIVE_LINGER_S`. A replica nobody waits on therefore costs no delivery per event. While it is
being bound, an event the status service has not applied yet can slip by unheard; the request
then answers at its deadline (long-poll) or next periodic re-read (stream), never wrongly.

The registry is in memory, bounded per replica and per tenant, and does no I/O at import.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import random
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Protocol

from pydantic import ValidationError

from services.gateway.errors import DatabaseUnavailable, GatewayError, Unavailable
from services.gateway.submissions import Submissions, recently_due
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import (
    CACHED_COMPLETION_SEQUENCE,
    ScoreResult,
    StateChange,
    TaskAccepted,
    TaskEvent,
    TaskHistory,
    TaskStatus,
    TaskView,
    parse_task_event,
)
from shared.topology import EVENTS, LIVE_EVENTS_BINDING, LIVE_EVENTS_PREFIX, live_events_queue

if TYPE_CHECKING:
    from aio_pika.abc import AbstractQueue

log = logging.getLogger("scorebox.gateway.push")

WAITER_QUEUE_SIZE = 32
RECENT_TASKS = 4_096  # tasks whose latest events are remembered
RECENT_EVENTS_PER_TASK = 8
RECENT_S = 30.0
# Over how long the waiters re-read once the live queue's connection is restored.
RESTORED_SPREAD_S = 1.0
# Pauses between the reads of `read_settled`/`history_settled`: the first after 20 ms (the
# status service usually lags by less), then twice as long each time up to 400 ms, each up to
# a quarter shorter at random so that the waiters one event woke spread their reads out. Over
# a 2 s `LIVE_SETTLE_S` that is at most about a dozen reads per waiter.
SETTLE_FIRST_PAUSE_S = 0.02
SETTLE_MAX_PAUSE_S = 0.4
SETTLE_JITTER = 0.25
LIVE_LINGER_S = 30.0  # how long the live queue stays bound after its last waiter
BIND_RETRY_S = 5.0  # after a failed bind, how long waiters go on without trying again
# How long after its deadline a long-poll's last read (started at the deadline, or a settling
# read just before it) may take before the latest view read answers.
LONG_POLL_MARGIN_S = 1.0
Clock = Callable[[], datetime]


class WaiterLimitReached(GatewayError):
    """Too many requests already wait for live updates (`per_tenant`: the caller's share)."""

    retry_after_s = 1

    def __init__(self, *, per_tenant: bool) -> None:
        super().__init__("per tenant" if per_tenant else "on this replica")
        self.per_tenant = per_tenant


class Waiter:
    """One waiting request's inbox of task events, bounded: on overflow it drops the newest
    and remembers that it `missed` some, so its reader re-reads the history instead. Once
    `stopped` (the replica is stopping), it hands out no more events."""

    def __init__(self, task_id: str, tenant_id: str, size: int = WAITER_QUEUE_SIZE) -> None:
        self.task_id = task_id
        self.tenant_id = tenant_id
        self.missed = False
        self.stopped = False
        self._nudged = False  # a None of `nudge` waits in `_events`
        # None: wakes a reader to see that the waiter stopped.
        self._events: asyncio.Queue[TaskEvent | None] = asyncio.Queue(maxsize=size)

    def offer(self, event: TaskEvent) -> None:
        try:
            self._events.put_nowait(event)
        except asyncio.QueueFull:
            self.missed = True

    def stop(self) -> None:
        self.stopped = True
        with contextlib.suppress(asyncio.QueueFull):  # full: its reader is not blocked
            self._events.put_nowait(None)

    def nudge(self) -> None:
        """Events may have been missed: its reader re-reads at once (`next` gives None, once
        however often it is nudged before it reads)."""
        self.missed = True
        if self._nudged:
            return
        with contextlib.suppress(asyncio.QueueFull):  # full: its reader is not blocked
            self._events.put_nowait(None)
            self._nudged = True

    async def next(self, timeout: float) -> TaskEvent | None:
        """The next event, or None when `timeout` seconds pass without one or the waiter
        stopped."""
        if timeout <= 0 or self.stopped:
            return None
        try:
            async with asyncio.timeout(timeout):
                event = await self._events.get()
        except TimeoutError:
            return None
        if event is None:
            self._nudged = False
        return event


class LiveUpdates:
    """Fans task events out to the waiters of their task, in-process."""

    def __init__(
        self,
        *,
        max_waiters: int = 10_000,
        max_per_tenant: int = 1_000,
        queue_size: int = WAITER_QUEUE_SIZE,
        recent_s: float = RECENT_S,
        monotonic: Callable[[], float] = time.monotonic,
        binding: Binding | None = None,
        linger_s: float = LIVE_LINGER_S,
    ) -> None:
        self._binding = OnDemandBinding(binding, linger_s, self, monotonic) if binding else None
        self._spread = random.Random()  # noqa: S311 - spreading reads out, not cryptography
        self._max_waiters = max_waiters
        self._max_per_tenant = max_per_tenant
        self._queue_size = queue_size
        self._by_task: dict[str, set[Waiter]] = {}
        self._per_tenant: dict[str, int] = {}
        self._count = 0
        self._recent: OrderedDict[str, list[tuple[float, TaskEvent]]] = OrderedDict()
        self._recent_s = recent_s
        self._monotonic = monotonic
        self._stopping = False

    def __len__(self) -> int:
        return self._count

    def open(self, task_id: str, tenant_id: str) -> Waiter:
        """Register a waiter for `task_id`; `WaiterLimitReached` when over a limit."""
        if self._count >= self._max_waiters:
            raise WaiterLimitReached(per_tenant=False)
        if self._per_tenant.get(tenant_id, 0) >= self._max_per_tenant:
            raise WaiterLimitReached(per_tenant=True)
        waiter = Waiter(task_id, tenant_id, self._queue_size)
        if self._stopping:
            waiter.stop()
        self._by_task.setdefault(task_id, set()).add(waiter)
        self._per_tenant[tenant_id] = self._per_tenant.get(tenant_id, 0) + 1
        self._count += 1
        since = self._monotonic() - self._recent_s
        self._forget_heard_before(since)
        for heard_at, event in self._recent.get(task_id, ()):
            if heard_at >= since and event.tenant_id == tenant_id:
                waiter.offer(event)
        return waiter

    def close(self, waiter: Waiter) -> None:
        """Unregister a waiter; closing one twice is harmless."""
        waiters = self._by_task.get(waiter.task_id)
        if waiters is None or waiter not in waiters:
            return
        waiters.discard(waiter)
        if not waiters:
            del self._by_task[waiter.task_id]
        remaining = self._per_tenant[waiter.tenant_id] - 1
        if remaining:
            self._per_tenant[waiter.tenant_id] = remaining
        else:
            del self._per_tenant[waiter.tenant_id]
        self._count -= 1

    def stop_waiting(self) -> None:
        """The replica is stopping: every waiter, and any opened from now on, stops at once
        (a stream ends, its client resuming on another replica; a long-poll answers the view
        as it is). Left waiting, they were cut off when the HTTP server's drain ran out: a
        long-poll answered a plain-text 500, a stream a truncated body."""
        self._stopping = True
        for waiter in self._waiters():
            waiter.stop()

    def note_bound(self) -> None:
        """The live queue was just bound: every waiter may have missed an event published
        before, which reached no queue of this replica; a stream re-reads at its next
        heartbeat (a long-poll reads after the bind)."""
        for waiter in self._waiters():
            waiter.missed = True

    def note_restored(self) -> None:
        """The live queue's connection is back, its queue and binding restored: every waiter
        may have missed an event published while it was down, and re-reads, within
        `RESTORED_SPREAD_S`. A stream heard of it at its next periodic re-read (`RESYNC_S`),
        a long-poll at its deadline (review of live updates). Spread, so that a replica's
        thousands of waiters do not all read the status service at once as it, too, comes
        back from the broker's restart (its re-read)."""
        loop = asyncio.get_running_loop()
        for waiter in self._waiters():
            loop.call_later(self._spread.uniform(0, RESTORED_SPREAD_S), waiter.nudge)

    def _waiters(self) -> Iterator[Waiter]:
        for waiters in self._by_task.values():
            yield from waiters

    @contextlib.contextmanager
    def waiting(self, task_id: str, tenant_id: str) -> Iterator[Waiter]:
        waiter = self.open(task_id, tenant_id)
        try:
            yield waiter
        finally:
            self.close(waiter)

    async def listen(self) -> None:
        """Make sure task events reach this replica; waiters call it before their first read."""
        if self._binding is not None:
            await self._binding.ensure()

    @property
    def listening(self) -> bool:
        """Whether task events may reach this replica: bound, or its unbinding not done."""
        return self.bound or (self._binding is not None and self._binding.unbinding)

    @property
    def bound(self) -> bool:
        """Whether task events reach this replica and will until no request waits."""
        return self._binding is None or self._binding.bound

    async def stop_listening(self) -> None:
        """Stop keeping the binding (at shutdown, before the broker stops)."""
        if self._binding is not None:
            await self._binding.close()

    def deliver(self, event: TaskEvent) -> int:
        """Hand `event` to every waiter of its task (and tenant); returns how many."""
        self._remember(event)
        delivered = 0
        for waiter in self._by_task.get(event.task_id, ()):
            if waiter.tenant_id == event.tenant_id:
                waiter.offer(event)
                delivered += 1
        return delivered

    def _remember(self, event: TaskEvent) -> None:
        now = self._monotonic()
        recent = self._recent.pop(event.task_id, [])
        recent.append((now, _slim(event)))
        self._recent[event.task_id] = recent[-RECENT_EVENTS_PER_TASK:]
        while len(self._recent) > RECENT_TASKS:
            self._recent.popitem(last=False)
        self._forget_heard_before(now - self._recent_s)

    def _forget_heard_before(self, since: float) -> None:
        """Drop the tasks last heard of before `since`, at each event and each new waiter (the
        memory is ordered by when each task was last heard of)."""
        while self._recent and next(iter(self._recent.values()))[-1][0] < since:
            self._recent.popitem(last=False)


def _slim(event: TaskEvent) -> TaskEvent:
    """An event as a new waiter needs it: an acceptance without the client's metadata,
    rubric and callback, which no waiter reads (up to 8 KB and 4,000 characters in each of
    the 4,096 x 8 events remembered)."""
    if isinstance(event, TaskAccepted):
        return event.model_copy(update={"metadata": {}, "rubric": None, "callback_url": None})
    return event


class Binding(Protocol):
    async def bind(self) -> None: ...
    async def unbind(self) -> None: ...


class OnDemandBinding:
    """Keeps a `Binding` in place while `waiters` has waiters, and `linger_s` after the last.

    While bound it re-asserts the binding every `linger_s` (idempotent on the broker): aio-pika
    binds a robust queue again after a reconnection, and this covers a binding lost any
    other way (one an unbind that timed out may still have removed).
    """

    def __init__(
        self,
        binding: Binding,
        linger_s: float,
        waiters: LiveUpdates,
        monotonic: Callable[[], float],
    ) -> None:
        self._binding = binding
        self._linger_s = linger_s
        self._waiters = waiters
        self._monotonic = monotonic
        self._lock = asyncio.Lock()
        self._last_wanted = 0.0
        self._keeper: asyncio.Task[None] | None = None
        self._binding_now: asyncio.Task[None] | None = None
        self._retry_at = 0.0
        self.bound = False
        self.unbinding = False  # released, its unbind still on its way

    async def ensure(self) -> None:
        """Bind unless bound. Waiters arriving together share one attempt; after a failed one
        (the broker away), waiters go on without live events for `BIND_RETRY_S`: each of them
        waiting out a bind of its own, one after the other, made the k-th long-poll of a burst
        wait k bind timeouts."""
        self._last_wanted = self._monotonic()
        if self.bound:
            return
        if self._binding_now is None:
            if self._monotonic() < self._retry_at:
                return
            self._binding_now = asyncio.create_task(self._bind())
        await asyncio.shield(self._binding_now)

    async def _bind(self) -> None:
        try:
            async with self._lock:
                if self.bound:
                    return
                try:
                    await self._binding.bind()
                except Exception as error:  # noqa: BLE001 - without live events waiters still answer
                    log.warning("live events unavailable (binding failed): %r", error)
                    self._retry_at = self._monotonic() + BIND_RETRY_S
                    return
                self.bound = True
                self._waiters.note_bound()
                if self._keeper is None or self._keeper.done():
                    self._keeper = asyncio.create_task(self._keep_while_wanted())
        finally:
            self._binding_now = None

    async def close(self) -> None:
        if self._binding_now is not None:
            self._binding_now.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._binding_now
        if self._keeper is not None:
            self._keeper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._keeper
            self._keeper = None

    async def _keep_while_wanted(self) -> None:
        while True:
            await asyncio.sleep(self._linger_s)
            async with self._lock:
                if len(self._waiters) or self._monotonic() - self._last_wanted < self._linger_s:
                    await self._reassert()
                    continue
                await self._release()
                return

    async def _reassert(self) -> None:
        try:
            await self._binding.bind()
        except Exception as error:  # noqa: BLE001 - retried at the next interval
            log.warning("live events binding not re-asserted: %r", error)

    async def _release(self) -> None:
        # Not bound from here on: a waiter arriving now binds again, after this (the lock).
        self.bound, self.unbinding = False, True
        try:
            await self._binding.unbind()
        except Exception as error:  # noqa: BLE001 - a stale binding costs only deliveries
            log.warning("live events binding not removed: %r", error)
        finally:
            self.unbinding = False


@dataclass(frozen=True)
class BrokerLiveBinding:
    """Binds this replica's live queue to `scorebox.events` for task events, on the
    connection that consumes it (the queue is exclusive to that connection)."""

    broker: ScoreboxBroker
    replica_id: str
    timeout_s: float

    # The whole call is bounded, not only its round trip (aio-pika's `timeout`): on a robust
    # channel, `bind` first waits for the connection to be up, without end while the broker
    # is away, and long-polls queued behind it past their deadlines.
    async def bind(self) -> None:
        async with asyncio.timeout(self.timeout_s):
            await self._queue().bind(
                EVENTS.name, routing_key=LIVE_EVENTS_BINDING, timeout=self.timeout_s
            )

    async def unbind(self) -> None:
        async with asyncio.timeout(self.timeout_s):
            await self._queue().unbind(
                EVENTS.name, routing_key=LIVE_EVENTS_BINDING, timeout=self.timeout_s
            )

    def _queue(self) -> AbstractQueue:
        name = live_events_queue(self.replica_id).name
        queue = self.broker.consumed_queue(name)
        if queue is None:
            raise LiveQueueUnavailable(f"{name} is not being consumed (the broker is not started)")
        return queue


class LiveQueueUnavailable(Exception):
    """The live queue is not there to bind: its consumer has not started."""


def subscribe_live_updates(broker: ScoreboxBroker, live: LiveUpdates, *, replica_id: str) -> None:
    """Consume this replica's live queue (auto-acknowledged: a lost event costs only latency).
    The queue receives events only while `live` binds it (`BrokerLiveBinding`); what it
    missed while its connection was down, the waiters re-read once it is back."""
    broker.when_own_queues_restored(live.note_restored)

    @consume(
        broker,
        live_events_queue(replica_id),
        ack_first=True,
        metric_label=LIVE_EVENTS_PREFIX.removesuffix("."),
    )
    async def wake_waiters(message: Delivery) -> None:
        routing_key = message.routing_key
        try:
            event = parse_task_event(routing_key, message.body)
        except (KeyError, ValidationError) as error:
            # The status projection dead-letters unreadable events; here they are only noise.
            log.debug("ignoring an unreadable %r live event: %s", routing_key, error)
            return
        live.deliver(event)


# --- Reads that wait for the status service to reflect a live event --------------------------

ViewReader = Callable[[], Awaitable[TaskView | None]]
HistoryReader = Callable[[int], Awaitable[TaskHistory | None]]


class HistorySource(Protocol):
    async def history(self, task_id: str, *, tenant_id: str, after: int) -> TaskHistory | None: ...


class _SettleBackOff:
    """The pauses between the reads of one settling wait, and its deadline `settle_s` away."""

    _jitter = random.Random()  # noqa: S311 - spreading reads out, not cryptography

    def __init__(self, settle_s: float) -> None:
        self._time = asyncio.get_running_loop().time
        self._deadline = self._time() + settle_s
        self._pause = SETTLE_FIRST_PAUSE_S

    @property
    def over(self) -> bool:
        return self._time() >= self._deadline

    async def pause(self) -> None:
        """Wait the next pause, never past the deadline (a last read is made there)."""
        pause = self._pause * (1 - SETTLE_JITTER * self._jitter.random())
        self._pause = min(self._pause * 2, SETTLE_MAX_PAUSE_S)
        await asyncio.sleep(max(0.0, min(pause, self._deadline - self._time())))


async def read_settled(read: ViewReader, event: TaskEvent, *, settle_s: float) -> TaskView | None:
    """Read the view until it reflects `event` (its sequence), for at most `settle_s`."""
    back_off = _SettleBackOff(settle_s)
    while True:
        view = await read()
        if view is not None and view.sequence is not None and view.sequence >= event.sequence:
            return view
        if back_off.over:
            return view
        await back_off.pause()


async def read_when_changed(
    read: ViewReader,
    *,
    live: LiveUpdates,
    task_id: str,
    tenant_id: str,
    wait_s: float,
    known_status: TaskStatus | None,
    settle_s: float,
    clock: Callable[[], datetime],
) -> TaskView | None:
    """Long-poll: the view at once when it is terminal (or differs from `known_status`), else
    after the task's next state change, else after `wait_s` seconds (the view as it is). A
    scheduled task's coming due is a change too, though no event tells it (`ComingDue`, at
    its `not_before` on `clock`, the service's, which the status service judges it by).

    The first read's `Unavailable` is the caller's to answer; any later one answers the
    view held (`_next_news`).

    A change heard live that the status service has not recorded within `settle_s` is no
    answer yet (the view would show the client what it has): the wait goes on, reading again
    for it at growing intervals (`Unrecorded`), until a view shows it, a later change comes
    or the deadline. The whole wait ends `LONG_POLL_MARGIN_S` after its deadline, a read then
    still under way or not (a slow status service): the answer is the latest view read."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s  # binding counts against the wait
    with live.waiting(task_id, tenant_id) as waiter:  # before the read: no event slips by

        def answers_at_once(view: TaskView | None) -> bool:
            if view is None or view.status.is_terminal or waiter.stopped:
                return True
            return known_status is not None and view.status != known_status

        if wait_s <= 0:
            return await read()
        view = await _first_read(read, live, wait_s, answers_at_once)
        if view is None or answers_at_once(view):
            return view
        waiting = _Waiting(read, waiter, view, deadline, settle_s, clock)
        bound = asyncio.timeout_at(deadline + LONG_POLL_MARGIN_S)
        try:
            async with bound:
                return await _next_news(waiting)
        except TimeoutError:
            if not bound.expired():
                raise
            return waiting.view


async def _first_read(
    read: ViewReader,
    live: LiveUpdates,
    wait_s: float,
    answers_at_once: Callable[[TaskView | None], bool],
) -> TaskView | None:
    """The view a long-poll starts from, read once the live binding is in place, so that no
    event slips between the read and the binding. While it is not in place yet, the view is
    read meanwhile too, and one that answers at once is answered without waiting for the
    bind: with the broker away, a finished task's long-poll waited a whole bind attempt
    (`BROKER_TIMEOUT_S`, 10 s) for what a poll answered at once (a review). Otherwise the
    view is read again once the bind has ended. While the binding is being removed, it is
    not in place either: a bind waits for the removal, over a stalled broker up to
    `BROKER_TIMEOUT_S`, then for its own attempt (review of live updates)."""
    if live.bound:
        await listen_within(live, wait_s)  # marks the binding wanted
        return await read()
    binding = asyncio.create_task(listen_within(live, wait_s))
    try:
        view = await read()
    except BaseException:
        await _cancelled(binding)
        raise
    if answers_at_once(view):
        await _cancelled(binding)  # the shared bind goes on for later waiters
        return view
    await binding
    return await read()


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel `task` and wait for it to end; a cancellation of the caller meanwhile is not
    swallowed (`asyncio.wait` raises none of the task's)."""
    task.cancel()
    await asyncio.wait([task])


@dataclass
class _Waiting:
    """A long-poll past its first read: the view it holds (the latest the status service
    showed) and when its wait ends."""

    read: ViewReader
    waiter: Waiter
    view: TaskView
    deadline: float
    settle_s: float
    clock: Callable[[], datetime]


async def _next_news(waiting: _Waiting) -> TaskView | None:
    loop = asyncio.get_running_loop()
    waiter, deadline = waiting.waiter, waiting.deadline

    async def read() -> TaskView | None:
        """A read past the first: the status service away (a blip, a full connection pool
        as one event wakes many waiters), the view held is the answer. It was a 503 for a
        client that had waited up to a minute, at the moment of its change (found in
        review); told its old status, it polls again."""
        try:
            return await waiting.read()
        except Unavailable as error:
            # DEBUG: every waiter reads again until its deadline; the client says the outage.
            log.debug("a long-poll keeps the view it held: %r", error)
            return waiting.view

    unrecorded = Unrecorded(waiting.settle_s)
    coming_due = ComingDue(waiting.view, loop.time(), today=waiting.clock())
    while True:
        event = await waiter.next(
            min(deadline, unrecorded.recheck_at, coming_due.recheck_at) - loop.time()
        )
        if waiter.stopped:
            return await read()  # the replica is stopping
        settling = waiting.settle_s
        if event is None and waiter.missed and loop.time() < deadline:
            waiter.missed = False  # events were lost (`LiveUpdates.note_restored`)
            fresh = await read()
            if fresh is None or _news(waiting.view, fresh):
                return fresh
            continue
        if event is None:
            if coming_due.recheck_at <= loop.time() < deadline:
                due = await read()
                if due is None or due.status != waiting.view.status:
                    return due
                coming_due.not_yet(loop.time())
                continue
            if unrecorded.event is None or loop.time() >= deadline:
                return await read()
            event, settling = unrecorded.event, 0  # one read for it
        elif waiting.view.sequence is not None and event.sequence <= waiting.view.sequence:
            continue  # heard before the first read, which shows it
        fresh = await read_settled(read, event, settle_s=settling)
        if fresh is None or _news(waiting.view, fresh):
            return fresh
        if waiting.view.sequence is None:
            waiting.view = fresh  # the status service's own view, from now on
        unrecorded.after(event, fresh, loop.time())


class ComingDue:
    """When a long-poll of a scheduled task reads it again: at its `not_before`, when its
    status turns `queued` with no event to say so (the status service derives it as it reads),
    then, should the read still show it scheduled (clocks apart), after growing pauses."""

    def __init__(self, view: TaskView, now: float, *, today: datetime) -> None:
        self.recheck_at = math.inf
        self._pause = SETTLE_MAX_PAUSE_S
        if view.status is TaskStatus.SCHEDULED and view.not_before is not None:
            ahead = (view.not_before - today).total_seconds()
            self.recheck_at = now + max(ahead, 0.0)

    def not_yet(self, now: float) -> None:
        self.recheck_at = now + self._pause
        self._pause *= 2


class Unrecorded:
    """A change a long-poll heard live that the status service's view does not show yet, and
    when to read again for it: `settle_s` (at least the longest settling pause) after the
    settling read gave up, then twice as long each time. Answering the stale view at once
    made the client long-poll again and settle again, every `settle_s`; waiting for the
    deadline alone left an end heard live (no event follows it) unanswered for up to 60 s."""

    def __init__(self, settle_s: float) -> None:
        self.event: TaskEvent | None = None
        self.recheck_at = math.inf
        self._interval = max(settle_s, SETTLE_MAX_PAUSE_S)

    def after(self, event: TaskEvent, fresh: TaskView, now: float) -> None:
        """`fresh` was read for `event`: remember the newest change heard until a view shows
        it."""
        if self.event is not None and self.event.sequence > event.sequence:
            event = self.event
        if fresh.sequence is not None and fresh.sequence >= event.sequence:
            self.event, self.recheck_at = None, math.inf
            return
        self.event, self.recheck_at = event, now + self._interval
        self._interval *= 2


def _news(view: TaskView, fresh: TaskView) -> bool:
    """Whether `fresh` shows a change the client has not seen in `view` (whose status is the
    one it has): a newer sequence. Not a view the status service has not updated yet (it lags
    the change heard live by more than `settle_s`): answered, it showed the client what it
    had, as if it were the change. And for a task the long-poll found only in the gateway's
    own record (no sequence), a status of its own: its acceptance (`task.accepted` of a
    scheduled task) changed nothing the client can see, and answering at once broke "after
    its next state change"."""
    if view.sequence is None:
        return fresh.status != view.status or fresh.status.is_terminal
    return fresh.sequence is not None and fresh.sequence > view.sequence


async def listen_within(live: LiveUpdates, seconds: float) -> None:
    """`live.listen()`, given up after `seconds` (the bind goes on for later waiters)."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(seconds):
            await live.listen()


@dataclass(frozen=True)
class Settled:
    """Changes to show, and the newest sequence among them the status service has recorded:
    a change past it was heard live only, and a stream gives it no SSE `id` (a reconnection
    resuming from an id the history does not hold yet was refused as ahead of the task)."""

    changes: list[StateChange]
    recorded: int


async def history_settled(
    read: HistoryReader, *, after: int, event: TaskEvent, settle_s: float
) -> Settled:
    """The changes after `after` once the history holds `event` (at most `settle_s` later);
    `event` itself is added when the status service has not caught up by then, or could not
    be read (a stream then still shows a task's end that this replica has heard of)."""
    back_off = _SettleBackOff(settle_s)
    while True:
        try:
            history = await read(after)
        except Unavailable as error:
            log.debug("history unavailable, going on with the live event: %r", error)
            history = None
        changes = [] if history is None else history.changes
        recorded = max([after, *(change.sequence for change in changes)])
        if any(change.sequence == event.sequence for change in changes):
            return Settled(changes, recorded)
        if history is not None and history.sequence >= event.sequence:
            # A newer event won and the history slice dropped this one.
            return Settled(changes, recorded)
        if back_off.over:
            heard = sorted([*changes, StateChange.of_event(event)], key=lambda c: c.sequence)
            return Settled(heard, recorded)
        await back_off.pause()


@dataclass(frozen=True)
class HistoryPolicy:
    """Read-your-writes for histories: how young an unknown submission may be."""

    window: timedelta


def _cached_completion(cached: ScoreResult, created_at: datetime) -> StateChange:
    return StateChange(
        sequence=CACHED_COMPLETION_SEQUENCE,
        status=TaskStatus.COMPLETED,
        occurred_at=created_at,
        result=cached,
    )


def may_await_a_cached_completion(
    status: TaskStatus,
    sequence: int | None,
    accepted_at: datetime,
    *,
    now: datetime,
    window: timedelta,
) -> bool:
    """Whether the status service shows only the acceptance of what may be a result-cache hit,
    whose completion (a publish of its own) it has not applied: a task accepted within
    `window`, at sequence 0 and `queued`. Only then is the cache hit read; an older task's
    completion was announced again by the outbox sweep long since. The long-poll's rule
    (`submit._may_await_a_cached_completion`), for a stream's first read too."""
    young = accepted_at > now - window
    return young and sequence == 0 and status is TaskStatus.QUEUED


def _young_acceptance_alone(
    history: TaskHistory, after: int, *, now: datetime, window: timedelta
) -> StateChange | None:
    """The acceptance, on a client's first look at a history that holds only that, of a task
    accepted within `window` (`may_await_a_cached_completion`): a stream then reads whether
    a cache hit answered the task (it showed `queued` and waited, found in review)."""
    acceptance = next((c for c in history.changes if c.sequence == 0), None)
    if after >= 0 or acceptance is None:
        return None
    young = may_await_a_cached_completion(
        history.status, history.sequence, acceptance.occurred_at, now=now, window=window
    )
    return acceptance if young else None


async def _completed_from_the_cache(
    history: TaskHistory,
    acceptance: StateChange,
    submissions: Submissions,
    *,
    task_id: str,
    tenant_id: str,
) -> TaskHistory:
    """The acceptance the status service holds, followed by the cache hit's completion if one
    answered the task (dated as its acceptance, as its own publish is). The gateway's own
    database away, the history is the answer: a poll answers the status service's view then,
    and a new stream was refused (503, or a `retry:`-only stream for the whole outage)."""
    try:
        cached = await submissions.cached_result(task_id, tenant_id=tenant_id)
    except DatabaseUnavailable as error:
        log.warning("%s streamed without its submission: %r", task_id, error)
        return history
    if cached is None:
        return history
    completion = _cached_completion(cached, acceptance.occurred_at)
    return history.model_copy(
        update={
            "status": TaskStatus.COMPLETED,
            "sequence": CACHED_COMPLETION_SEQUENCE,
            "changes": [*history.changes, completion],
        }
    )


async def _ended_by_the_cache(
    history: TaskHistory, submissions: Submissions, *, task_id: str, tenant_id: str
) -> TaskHistory:
    """The history of a client that saw a result-cache hit's completion the status service
    has not recorded (an `EventSource` reconnecting after it): completed, nothing after it.
    Without the cache hit, the history as it is (the caller refuses the client's id as
    ahead of it). The database away, `DatabaseUnavailable`: without it, the client's id
    would be refused for good."""
    if await submissions.cached_result(task_id, tenant_id=tenant_id) is None:
        return history
    return history.model_copy(
        update={"status": TaskStatus.COMPLETED, "sequence": CACHED_COMPLETION_SEQUENCE}
    )


async def read_history(
    task_id: str,
    *,
    tenant_id: str,
    after: int,
    status: HistorySource,
    submissions: Submissions,
    clock: Clock,
    policy: HistoryPolicy,
) -> TaskHistory | None:
    """The task's state changes after `after`, or — while the status service has not heard of
    a young submission — its acceptance as the gateway recorded it (sequence 0, like the
    acceptance the projection reads from the command), and a result-cache hit's completion
    until the status service has recorded it (a client that saw it asks for what follows).

    Of the submission, only its cached result is read while the status service has the
    task, and only when the history may lack it: a client reconnecting after the cache
    hit's completion, or a first look at a young task's acceptance. A stream whose live
    changes run ahead of a lagging history re-reads it often, and nothing else ahead of it
    is the cache's."""
    history = await status.history(task_id, tenant_id=tenant_id, after=after)
    if history is None:
        return await _as_recorded(
            task_id,
            tenant_id=tenant_id,
            after=after,
            submissions=submissions,
            now=clock(),
            policy=policy,
        )
    if after == CACHED_COMPLETION_SEQUENCE > history.sequence:
        return await _ended_by_the_cache(history, submissions, task_id=task_id, tenant_id=tenant_id)
    acceptance = _young_acceptance_alone(history, after, now=clock(), window=policy.window)
    if acceptance is None:
        return history
    return await _completed_from_the_cache(
        history, acceptance, submissions, task_id=task_id, tenant_id=tenant_id
    )


async def _as_recorded(
    task_id: str,
    *,
    tenant_id: str,
    after: int,
    submissions: Submissions,
    now: datetime,
    policy: HistoryPolicy,
) -> TaskHistory | None:
    """A young submission the status service has not heard of, as the gateway recorded it."""
    submission = await submissions.find(task_id, tenant_id=tenant_id)
    if submission is None or not recently_due(submission, now=now, window=policy.window):
        return None
    scheduled = submission.not_before is not None and submission.not_before > now
    recorded = [
        StateChange(
            sequence=0,
            status=TaskStatus.SCHEDULED if scheduled else TaskStatus.QUEUED,
            occurred_at=submission.created_at,
        )
    ]
    if submission.cached_result is not None:  # answered from the result cache at once
        recorded.append(_cached_completion(submission.cached_result, submission.created_at))
    latest = recorded[-1]
    return TaskHistory(
        task_id=task_id,
        status=latest.status,
        sequence=latest.sequence,
        changes=[change for change in recorded if change.sequence > after],
    )
