"""Operating the score-requests dead-letter queue: list, show, replay, drop, purge.

Messages are read with `basic.get` and held unacknowledged while the queue is walked, then
returned with `basic.nack(requeue=True)` (`shared.dead_letters`), so looking never loses a
dead letter. Replay sends a fresh command — next generation, attempt 1, a fresh attempt
budget, queued now, to the scorer alone — and once the broker confirmed it, the status
projection is told the task is queued again (`TaskPublisher.resubmit`); then the dead letter
is acked. A letter a later generation superseded (a re-score of the task since) is acked
without sending anything: replayed, it scored the task once more; one whose task has a
re-score being sent at that moment is kept, for a later replay. Drop acks the letters one id
names (every copy) without sending anything.

A listing says when it was taken (`Walk.listed_at`, read before the walk); a drop or a purge
given a cut-off (`shared.dead_letters.CutOff`, that time) removes only the letters known to have
been dead-lettered before it and keeps the others, those dead-lettered after the listing first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Set
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from aio_pika.abc import AbstractIncomingMessage
from faststream.rabbit import RabbitBroker
from pydantic import ValidationError

from services.gateway.errors import BrokerUnavailable, Unavailable, refused_for_good
from services.gateway.rescore import Resubmitter
from services.gateway.submissions import ReplayRefused, Submissions
from shared.bus import BROKER_ERRORS
from shared.contracts import ScoreText, new_id
from shared.dead_letters import (
    MAX_WALK_BYTES,
    REPLAY_BUDGET_S,
    CutOff,
    DeadLetterWalker,
    Dropped,
    dead_lettered_at,
    letter_id,
    oldest_first,
    readable_body,
    reason,
    unmatched,
    with_url_shown,
)
from shared.topology import DEAD_LETTERED_FROM_HEADER, SCORE_REQUESTS

log = logging.getLogger("scorebox.gateway.dead_letters")


@dataclass(frozen=True)
class DeadLetter:
    message_id: str  # `letter_id`: made of the body when the letter has none
    task_id: str | None
    tenant_id: str | None
    reason: str
    attempts: int | None
    queue: str
    dead_lettered_at: datetime | None
    age_s: float | None
    body_preview: str

    def matches(self, ids: Set[str]) -> bool:
        """Whether `ids` names this letter (a set: a replay names up to 10,000 ids, tried
        against each of up to `MAX_WALK` letters)."""
        return self.message_id in ids or self.task_id in ids


def describe(message: AbstractIncomingMessage, now: datetime) -> DeadLetter:
    return described(message, now)[0]


def described(
    message: AbstractIncomingMessage, now: datetime
) -> tuple[DeadLetter, ScoreText | None]:
    """The letter as a listing shows it, and the command it holds (None: unreadable)."""
    headers = dict(message.headers)
    command: ScoreText | None = None
    with contextlib.suppress(ValidationError):
        command = ScoreText.model_validate_json(message.body)
    when = dead_lettered_at(message, now)
    letter = DeadLetter(
        message_id=letter_id(message),
        task_id=command.task_id if command else message.correlation_id,
        tenant_id=command.tenant_id if command else None,
        reason=reason(headers),
        attempts=command.attempt if command else None,
        queue=str(headers.get(DEAD_LETTERED_FROM_HEADER, SCORE_REQUESTS.name)),
        dead_lettered_at=when,
        age_s=(now - when).total_seconds() if when else None,
        body_preview=message.body[:200].decode("utf-8", "replace"),
    )
    return letter, command


@dataclass(frozen=True)
class ShownLetter:
    """A letter as `GET /admin/v1/dead-letters/{id}` shows it: what a listing says of it,
    and its whole body (the command, its text included), JSON when it parses."""

    letter: DeadLetter
    body: Any


@dataclass(frozen=True)
class Walk:
    """What one walk of the queue saw: its letters, oldest dead-lettered first, whether it
    stopped (at `MAX_WALK` letters or its byte budget) with letters left behind it, and when
    it was taken (the clock read before the walk began: a cut-off for a drop or a purge)."""

    letters: list[DeadLetter]
    truncated: bool
    listed_at: datetime


@dataclass(frozen=True)
class Replay:
    replayed: list[str]
    skipped_unreadable: list[str]
    not_found: list[str]  # ids no letter matched, the walk having reached the queue's end
    not_reached: list[str]  # ids of letters the walk or the budget left (see `unmatched`)
    truncated: bool  # the walk stopped with letters left behind it
    timed_out: bool = False  # the budget ran out with letters matched and left
    # Task ids of letters a later generation superseded, removed unsent (one per letter).
    superseded: list[str] = field(default_factory=list)
    # Task ids of letters kept because a re-score of their task is being sent (one per letter).
    skipped_being_rescored: list[str] = field(default_factory=list)
    # Why the replay stopped before the letters `not_reached`: the broker or the database
    # failed once some were handled (what was done is above).
    interrupted: str | None = None


@dataclass
class _ReplayTally:
    """What a replay did so far, and the letters it left: by (task, generation), for a
    letter left is done when a copy of it (the same task and generation) was replayed or
    superseded, and not when another generation's letter of its task was (a re-score's
    letter beside the one it superseded)."""

    replayed: list[str] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)
    superseded: list[str] = field(default_factory=list)
    being_rescored: list[str] = field(default_factory=list)
    found: set[str] = field(default_factory=set)
    interrupted: str | None = None
    _handled: set[tuple[str, int]] = field(default_factory=set)
    _left: list[tuple[set[str], tuple[str, int]]] = field(default_factory=list)

    @property
    def acted(self) -> bool:
        return bool(self.replayed or self.superseded)

    def done(self, command: ScoreText, *, sent: bool) -> None:
        (self.replayed if sent else self.superseded).append(command.task_id)
        self._handled.add((command.task_id, command.generation))

    def leave(self, keys: set[str], command: ScoreText) -> None:
        self._left.append((keys, (command.task_id, command.generation)))

    def left_unhandled(self) -> set[str]:
        """The ids of the letters left whose copies were not handled either."""
        return {key for keys, copy in self._left if copy not in self._handled for key in keys}


def _interruption(error: BaseException) -> str:
    """Why a replay stopped part-way, for its answer (`Replay.interrupted`); logged."""
    if refused_for_good(error):
        log.error("a dead-letter replay stopped: the database refused for good", exc_info=error)
        refusal = type(error.__cause__ or error).__name__  # the driver's, not our wrapper's
        return (
            f"The database refused an operation for good ({refusal}; the gateway's log has "
            "it): asking again meets the same refusal until it is mended."
        )
    log.warning("a dead-letter replay stopped part-way: %r", error)
    return unavailable_detail(error)


def unavailable_detail(error: BaseException) -> str:
    """What a broker or database failure tells an operator, in words (`Unavailable.away`;
    the broker's own errors are the message broker's), as a 503 says it."""
    away = (
        error.away if isinstance(error, Unavailable) else BrokerUnavailable.what + " is unavailable"
    )
    return f"{away}; try again shortly."


def _oldest_first(letter: DeadLetter) -> tuple[bool, datetime]:
    return oldest_first(letter.dead_lettered_at)


class DeadLetterQueue:
    def __init__(
        self,
        broker: RabbitBroker,
        publisher: Resubmitter,
        submissions: Submissions,
        clock: Callable[[], datetime],
        *,
        timeout_s: float,
        walk_bytes: int = MAX_WALK_BYTES,
        replay_budget_s: float = REPLAY_BUDGET_S,
    ) -> None:
        self._publisher = publisher
        self._replay_budget_s = replay_budget_s
        self._submissions = submissions
        self._clock = clock
        # Walks through this replica take turns (a letter held by one is invisible to
        # another; those of other replicas still may not see a letter: `not_found` says so).
        # A walk's bodies are bounded too (`walk_bytes`): each holds a text of up to 50,000
        # characters, and 10,000 of them held for one admin request were up to about 2 GB.
        self._dlq = DeadLetterWalker(
            broker, SCORE_REQUESTS, timeout_s=timeout_s, max_bytes=walk_bytes
        )

    async def letters(self) -> Walk:
        """Every dead letter (up to `MAX_WALK` and the walk's byte budget), sorted by when it
        was dead-lettered: returned
        letters come back to a quorum queue out of order, so the queue's own order changes
        with every look."""
        now = self._clock()
        async with self._dlq.walk() as held:
            letters = [describe(message, now) for message in held]
        letters.sort(key=_oldest_first)
        return Walk(letters, truncated=held.stopped_short, listed_at=now)

    async def shown(self, letter_id: str) -> ShownLetter | Walk:
        """The letter `letter_id` names (message or task id) with its whole body, which a
        listing cuts to `body_preview`: of several (a task's letters of several attempts),
        the oldest, as the listing shows them first; else what the walk saw (it may have
        stopped short)."""
        now = self._clock()
        seen: list[DeadLetter] = []
        found: list[ShownLetter] = []
        async with self._dlq.walk() as held:
            for message in held:
                letter = describe(message, now)
                seen.append(letter)
                if letter.matches({letter_id}):
                    body = with_url_shown(readable_body(message.body), "callback_url")
                    found.append(ShownLetter(letter, body))
        if found:
            return min(found, key=lambda shown: _oldest_first(shown.letter))
        return Walk(seen, truncated=held.stopped_short, listed_at=now)

    async def replay(self, ids: Collection[str] | None) -> Replay:
        """Replay the dead letters named by `ids` (all when None), for up to the replay's
        budget (`REPLAY_BUDGET_S`, its turn and the walk included): the letters
        matched then are left as they are and reported (`timed_out`; the ids they hold
        `not_reached`), so the answer comes within a client's timeout. A letter a later
        generation superseded is removed unsent (`superseded`).

        The broker or the database failing once letters were replayed or removed stops the
        replay there, the rest left as the budget leaves them (`interrupted` says why): a
        503 would have hidden what was done, and the retry it asks for found those letters
        gone (`not_found`). Failing before anything was done, it raises (a 503: nothing
        changed).

        Matched as a set: looked up in a list, 10,000 ids against 10,000 letters were 10^8
        string comparisons on the event loop, every request of the replica stalled meanwhile.
        """
        loop = asyncio.get_running_loop()
        stop_at = loop.time() + self._replay_budget_s
        wanted = None if ids is None else frozenset(ids)
        tally = _ReplayTally()
        now = self._clock()
        async with self._dlq.walk(deadline=stop_at) as held:
            for message in held:
                letter, command = described(message, now)
                if wanted is not None and not letter.matches(wanted):
                    continue
                keys = {key for key in (letter.message_id, letter.task_id) if key}
                tally.found.update(keys)
                if command is None:
                    tally.skipped.append(letter.message_id)
                    continue
                # Any letter tried counts: a superseded one costs round trips too.
                if tally.interrupted or (tally.acted and loop.time() >= stop_at):
                    tally.leave(keys, command)
                    continue
                try:
                    refused = await self._resubmit(command)
                except (*BROKER_ERRORS, Unavailable) as error:
                    if not tally.acted:
                        raise
                    tally.interrupted = _interruption(error)
                    tally.leave(keys, command)
                    continue
                if refused is ReplayRefused.RESCORE_BEING_SENT:
                    tally.being_rescored.append(command.task_id)  # kept for a later replay
                    continue
                # Sent (or superseded): done, whatever becomes of the ack. A letter whose ack
                # fails stays in the queue, and a replay sends it again as the same
                # generation, which the scorer's claim takes once.
                tally.done(command, sent=refused is None)
                try:
                    await self._dlq.remove(message)  # superseded: obsolete, as a drop removes
                except BROKER_ERRORS as error:
                    tally.interrupted = _interruption(error)
        left = tally.left_unhandled()
        not_found, not_reached = unmatched(
            ids or [], tally.found, truncated=held.stopped_short, left=left
        )
        return Replay(
            tally.replayed,
            tally.skipped,
            not_found,
            not_reached,
            truncated=held.truncated,
            timed_out=held.timed_out or (bool(left) and tally.interrupted is None),
            superseded=tally.superseded,
            skipped_being_rescored=tally.being_rescored,
            interrupted=tally.interrupted,
        )

    async def drop(self, letter_id: str, *, cut_off: CutOff | None = None) -> Dropped:
        """Remove every letter `letter_id` names (message or task id), nothing sent: each
        copy of one letter, as a replay would replay each; given a `cut_off`, only those
        known to have been dead-lettered before it (the others are `kept`)."""
        now = self._clock()
        named = frozenset({letter_id})
        return await self._dlq.drop(
            lambda message: describe(message, now).matches(named), cut_off=cut_off
        )

    async def _resubmit(self, command: ScoreText) -> ReplayRefused | None:
        """Send `command` again as its replay's generation (None); why nothing was sent
        otherwise: a later generation superseded it, or a re-score's claim above it is being
        sent."""
        # Taken from the submission, as a re-score takes its generation, so a re-score
        # requested before the replay's outcome arrives does not reuse the replay's; every
        # copy of one dead letter gets the same one.
        taken = await self._submissions.replay_generation(
            command.task_id, of=command.generation, now=self._clock()
        )
        if isinstance(taken, ReplayRefused):
            return taken
        fresh = command.model_copy(
            update={
                "generation": command.generation + 1 if taken is None else taken,
                "attempt": 1,
                # A fresh budget: the free rate-limited retries counted too, or the attempts
                # a replay may make grow by the old ones.
                "rate_limited_retries": 0,
                "not_before": None,
                "message_id": new_id(),
                "occurred_at": self._clock(),
            }
        )
        await self._publisher.resubmit(fresh)
        return None

    async def purge(self) -> int:
        return await self._dlq.purge()

    async def purge_before(self, cut_off: CutOff) -> Dropped:
        """Remove the letters a walk reaches that are known to have been dead-lettered before
        `cut_off`; the others are `kept`."""
        return await self._dlq.purge_before(cut_off)
