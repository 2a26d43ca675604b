"""Operating the webhook deliveries' dead-letter queue (`scorebox.webhook-deliveries.dlq`):
list, show, replay, drop, purge.

A delivery lands there when its retries ran out without an answer (a DNS, connect, TLS or
timeout error may be ours), at the queue's delivery limit, or unreadable; a receiver's own
refusals and failures are the tenant's business and are recorded, not dead-lettered
(docs/architecture.md). The queue is walked as the others are (`shared.dead_letters`: held
unacknowledged, then returned).

Replay moves a letter back to its work queue, as a shovel would: its body, message id and
headers, through the tasks exchange under `webhook.deliver`, with its reason kept in
`x-scorebox-error` (one of RabbitMQ's, which has none, gets `MOVED_BACK_REASON`) and its
delivery counts dropped (those were its earlier copy's, and one dead-lettered at the delivery
limit would have read as at it again). The notifier then reopens the delivery for a fresh
round of attempts (`services.notifier.deliveries.try_moved_back_letter_again`): one recorded
delivered since stays done, and copies of one letter moved back together POST it once. Once
the broker confirmed the copy, the letter is acked; a letter whose ack failed stays, and
replayed again is that same fresh round.

A letter is named by its delivery id (the `webhook-id` a receiver sees; every copy of it) or
its message id (the way to name one that is unreadable, which replay keeps). A listing says
when it was taken (`WebhookWalk.listed_at`): a drop or a purge given that cut-off removes
only the letters known to have been dead-lettered before it.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Any

from aio_pika.abc import AbstractIncomingMessage
from faststream.rabbit import RabbitBroker
from pydantic import ValidationError

from services.notifier.consumer import MOVED_BACK_REASON
from shared.bus import BROKER_ERRORS, send_raw
from shared.contracts import DeliverWebhook
from shared.dead_letters import (
    REPLAY_BUDGET_S,
    CutOff,
    DeadLetterWalker,
    Dropped,
    dead_lettered_at,
    letter_id,
    oldest_first,
    readable_body,
    reason,
    shown_url,
    unmatched,
    with_url_shown,
)
from shared.topology import (
    DEAD_LETTERED_FROM_HEADER,
    DELIVERY_COUNT_HEADER,
    EARLIER_DELIVERIES_HEADER,
    ERROR_HEADER,
    TASKS,
    WEBHOOK_DELIVERIES,
)

log = logging.getLogger("scorebox.notifier")
Clock = Callable[[], datetime]
BROKER_AWAY = "The message broker is unavailable; try again shortly."


@dataclass(frozen=True)
class WebhookDeadLetter:
    """One letter as an operator reads it; the delivery's fields are None when its body is
    not a readable `DeliverWebhook`. `url` is shown without credentials or query."""

    message_id: str
    reason: str
    queue: str
    dead_lettered_at: datetime | None
    delivery_id: str | None = None
    task_id: str | None = None
    tenant_id: str | None = None
    purpose: str | None = None
    event_type: str | None = None
    url: str | None = None
    attempt: int | None = None
    max_attempts: int | None = None


def _read(message: AbstractIncomingMessage) -> DeliverWebhook | None:
    try:
        return DeliverWebhook.model_validate_json(message.body)
    except ValidationError:
        return None


def describe(message: AbstractIncomingMessage, now: datetime) -> WebhookDeadLetter:
    letter = WebhookDeadLetter(
        message_id=letter_id(message),
        reason=reason(message.headers),
        queue=str(message.headers.get(DEAD_LETTERED_FROM_HEADER, WEBHOOK_DELIVERIES.name)),
        dead_lettered_at=dead_lettered_at(message, now),
    )
    delivery = _read(message)
    if delivery is None:
        return letter
    return replace(
        letter,
        delivery_id=delivery.delivery_id,
        task_id=delivery.task_id,
        tenant_id=delivery.tenant_id,
        purpose=delivery.purpose.value,
        event_type=delivery.event_type,
        url=shown_url(delivery.url),
        attempt=delivery.attempt,
        max_attempts=delivery.max_attempts,
    )


def _body(message: AbstractIncomingMessage) -> Any:
    """What a letter's webhook POSTs: not the whole command, whose URL the listing shows
    without its query. A letter that holds no delivery shows its whole body, its `url` shown
    as the listing's (one of another build, say, with a purpose this one does not know,
    showed its URL whole: a review)."""
    delivery = _read(message)
    if delivery is not None:
        return delivery.payload
    return with_url_shown(readable_body(message.body), "url")


def moved_back_headers(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The headers of a letter moved back to its queue: its own, its reason kept (the
    notifier reads a message carrying one as a letter moved back), its delivery counts
    dropped."""
    moved = {
        name: value
        for name, value in headers.items()
        if name not in (DELIVERY_COUNT_HEADER, EARLIER_DELIVERIES_HEADER)
    }
    moved.setdefault(ERROR_HEADER, MOVED_BACK_REASON)
    return moved


@dataclass(frozen=True)
class ShownWebhookLetter:
    """A letter as `GET .../dead-letters/{id}` shows it: what a listing says of it, and the
    JSON its webhook POSTs (an unreadable letter: its whole body, JSON when it parses)."""

    letter: WebhookDeadLetter
    body: Any


@dataclass(frozen=True)
class WebhookWalk:
    letters: list[WebhookDeadLetter]
    truncated: bool
    listed_at: datetime


@dataclass(frozen=True)
class MovedBack:
    delivery_id: str
    message_id: str
    attempt: int


@dataclass
class WebhookReplay:
    """What one replay did. `not_reached`: ids asked for past a walk cut short, or whose
    letters the budget or an interruption left in the queue."""

    replayed: list[MovedBack] = field(default_factory=list)
    skipped_unreadable: list[str] = field(default_factory=list)
    not_found: list[str] = field(default_factory=list)
    not_reached: list[str] = field(default_factory=list)
    truncated: bool = False
    timed_out: bool = False
    interrupted: str | None = None


@dataclass
class _Chosen:
    letters: list[tuple[AbstractIncomingMessage, DeliverWebhook]] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    found: set[str] = field(default_factory=set)


def _names(message: AbstractIncomingMessage, delivery: DeliverWebhook | None) -> set[str]:
    """The ids that name a letter: its message id, and its delivery's id."""
    return {letter_id(message)} | ({delivery.delivery_id} if delivery is not None else set())


def _chosen(
    held: list[AbstractIncomingMessage], wanted: frozenset[str] | None, now: datetime
) -> _Chosen:
    """The held letters `wanted` names (all when None), oldest dead-lettered first."""
    chosen = _Chosen()
    ordered = sorted(held, key=lambda message: oldest_first(dead_lettered_at(message, now)))
    for message in ordered:
        delivery = _read(message)
        names = _names(message, delivery)
        if wanted is not None and not names & wanted:
            continue
        chosen.found |= names
        if delivery is None:
            chosen.unreadable.append(letter_id(message))
        else:
            chosen.letters.append((message, delivery))
    return chosen


def interruption(error: BaseException) -> str:
    """Why a replay stopped part-way, in the words its 503 would have had (as the other
    DLQs' replays say it); logged."""
    log.warning("a webhook dead-letter replay stopped part-way: %r", error)
    return BROKER_AWAY


class WebhookDeadLetters:
    def __init__(
        self,
        walker: DeadLetterWalker,
        broker: RabbitBroker,
        *,
        clock: Clock,
        timeout_s: float,
        replay_budget_s: float = REPLAY_BUDGET_S,
    ) -> None:
        self._dlq = walker
        self._broker = broker
        self._clock = clock
        self._timeout_s = timeout_s
        self._replay_budget_s = replay_budget_s

    async def letters(self) -> WebhookWalk:
        now = self._clock()
        async with self._dlq.walk() as held:
            letters = [describe(message, now) for message in held]
        letters.sort(key=lambda letter: oldest_first(letter.dead_lettered_at))
        return WebhookWalk(letters, truncated=held.stopped_short, listed_at=now)

    async def shown(self, name: str) -> ShownWebhookLetter | WebhookWalk:
        """The letter `name` names (a delivery or message id) with what it POSTs; of several
        (copies of one delivery), the oldest, as the listing shows them first; else what the
        walk saw (it may have stopped short)."""
        now = self._clock()
        async with self._dlq.walk() as held:
            letters = [(describe(message, now), message) for message in held]
        found = [
            ShownWebhookLetter(letter, _body(message))
            for letter, message in letters
            if name in (letter.delivery_id, letter.message_id)
        ]
        if found:
            return min(found, key=lambda shown: oldest_first(shown.letter.dead_lettered_at))
        listed = [letter for letter, _ in letters]
        return WebhookWalk(listed, truncated=held.stopped_short, listed_at=now)

    async def replay(self, ids: Collection[str] | None) -> WebhookReplay:
        """Move the letters `ids` names (delivery or message ids; all when None) back to the
        webhook queue, oldest first, for up to the replay's budget (its turn and the walk
        included): those left then stay, `timed_out`. Unreadable letters are kept and
        reported. A broker failure before any letter was moved raises (`BROKER_ERRORS`);
        after one was, it ends the replay with what it did (`interrupted`)."""
        stop_at = asyncio.get_running_loop().time() + self._replay_budget_s
        wanted = None if ids is None else frozenset(ids)
        report = WebhookReplay()
        async with self._dlq.walk(deadline=stop_at) as held:
            chosen = _chosen(held, wanted, self._clock())
            left = await self._move_back(chosen.letters, stop_at, report)
        report.skipped_unreadable = chosen.unreadable
        report.not_found, report.not_reached = unmatched(
            ids or [], chosen.found, truncated=held.stopped_short, left=left
        )
        report.truncated = held.truncated
        report.timed_out = held.timed_out or (bool(left) and report.interrupted is None)
        return report

    async def _move_back(
        self,
        letters: list[tuple[AbstractIncomingMessage, DeliverWebhook]],
        stop_at: float,
        report: WebhookReplay,
    ) -> set[str]:
        """Move `letters` back in order until done, out of budget or interrupted; the ids
        naming the letters left (`_left`)."""
        loop = asyncio.get_running_loop()
        for index, (message, delivery) in enumerate(letters):
            if index and loop.time() >= stop_at:
                return _left(letters[index:], report)
            try:
                await self._send_back(message)
            except BROKER_ERRORS as error:
                if not report.replayed:
                    raise
                report.interrupted = interruption(error)
                return _left(letters[index:], report)
            report.replayed.append(
                MovedBack(delivery.delivery_id, letter_id(message), delivery.attempt)
            )
            try:
                await self._dlq.remove(message)
            except BROKER_ERRORS as error:  # moved all the same: replayed again, a no-op
                report.interrupted = interruption(error)
                return _left(letters[index + 1 :], report)
        return set()

    async def _send_back(self, message: AbstractIncomingMessage) -> None:
        await send_raw(
            self._broker,
            message.body,
            exchange=TASKS,
            routing_key=DeliverWebhook.routing_key,
            timeout=self._timeout_s,
            message_id=message.message_id,
            correlation_id=message.correlation_id,
            headers=moved_back_headers(message.headers),
        )

    async def drop(self, name: str, *, cut_off: CutOff | None = None) -> Dropped:
        """Remove every letter `name` names (a delivery id: each copy of it; or a message
        id), sending nothing. Given a `cut_off`, only those known to have been dead-lettered
        before it (the others are `kept`)."""
        return await self._dlq.drop(
            lambda message: name in _names(message, _read(message)), cut_off=cut_off
        )

    async def purge(self) -> int:
        return await self._dlq.purge()

    async def purge_before(self, cut_off: CutOff) -> Dropped:
        return await self._dlq.purge_before(cut_off)


def _left(
    letters: list[tuple[AbstractIncomingMessage, DeliverWebhook]], report: WebhookReplay
) -> set[str]:
    """The ids naming the letters left: each one's message id, and its delivery id unless
    another copy of that delivery was moved back (the delivery is reopened)."""
    moved = {letter.delivery_id for letter in report.replayed}
    return {letter_id(message) for message, _ in letters} | {
        delivery.delivery_id for _, delivery in letters if delivery.delivery_id not in moved
    }
