"""The scorer's broker adapter: decode → `score_text` → carry out the decision → ack.

What each outcome means on the broker:
- completed / failed: terminal event published (confirmed); a give-up is first copied to
  the DLQ with the reason in a header; then ack.
- retry: next attempt sent down the wait ladder, `task.retrying` published, then ack.
- not due / claimed elsewhere: sent down the wait ladder again, then ack.
- put off by a pause of the model calls: sent down the wait ladder again; a retry's attempt
  then tells its `task.retrying` again with the later due time (best effort), then ack.
- the scorer stopping before the delivery reached a model slot: sent again, then acked (a
  redelivery's copy carries its count, unchanged: a stop is no consumer death).
- unreadable body (poison): copied to the DLQ with the validation error, then ack.
- a copy to the DLQ the broker refuses for `LETTER_DEADLINE_S` (a long alarm, the DLQ
  deleted): the delivery is returned as failed instead (`keep_dead_lettering`), and the
  ack that follows is no frame (a delivery is settled once); RabbitMQ dead-letters it at
  the queue's delivery limit, without the reason.
- the handler itself crashed: re-sent after a delay with a crash counter; at the limit,
  given up: dead-lettered and failed.
- a process died (or lost its connection) holding the message: RabbitMQ redelivers it with
  `x-delivery-count`; while the dead holder's claim lasts, the redelivery is held, not
  re-sent, so the count keeps growing. Once that count and the one carried from earlier
  copies (below) reach the queue's delivery limit, the scorer dead-letters the message
  and fails the task instead of risking another crash (and should the scorer die before
  it can, RabbitMQ dead-letters it once its own count of this copy passes the limit).
  A message whose attempt no scorer ever claimed has done no work: its deliveries were lost
  waiting in a prefetch (each loss of the connection, each crash of the process on another
  message, returns every delivery in hand). At the limit it is sent again as a fresh copy
  with its count cleared instead, up to `UNSTARTED_RESETS` times (`x-scorebox-unstarted-resets`),
  so a message that kills the scorer before its claim still stops. That copy stands in for
  a lost delivery (`x-scorebox-replaces-lost`, carried on by every copy of it, as the count
  is): finding the attempt held by another delivery of this process, it waits for it as a
  redelivery does, since the holder may be the lost predecessor still waiting for a model
  slot, which will start nothing.
- a delivery at that limit (or at the crash limit, its give-up refused) whose attempt another
  claim still holds, or whose database is away for longer than `LIMIT_DATABASE_WAIT_S`: sent
  again as a fresh copy carrying its count unchanged, due when that claim's lease ends (or
  shortly), then acked; the copy comes back at the limit and looks again (`_handed_back`).
  Held instead, it came back counted once more when its connection dropped, and RabbitMQ
  dead-lettered it by its own count, without a reason.
- a give-up is recorded as the attempt's decision first, under a claim of this process:
  a later copy of the command (the gateway's outbox sweep, a retry replayed) then carries
  the failure out again instead of calling the model. Another worker's live claim is looked
  at again once its lease ends (the copy above), and its decision carried out instead.
- MongoDB unavailable (a transient error, `shared.database_errors`): re-sent after a delay
  without counting it as a crash. A permanent database error (a write refused for good: a
  failed validation, a document over 16 MiB) is a crash: re-sent uncounted, it came back
  for ever, calling the model each time its decision was refused. At the delivery limit,
  a recorded decision that cannot be read for good is taken for none, and the message
  given up (held, it stayed so for ever).
- every copy of the delivery's own command sent again (not due, claimed elsewhere, at stop,
  a crash, MongoDB unavailable) and its dead letter carry the deliveries
  its consumers lost so far (`x-scorebox-earlier-deliveries`: the delivery's carried value
  plus its `x-delivery-count`), for the copy's own count starts at zero; the limit above is
  checked on the two together. A retry's next attempt is a new command: it carries none.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

from faststream.rabbit import RabbitBroker
from pydantic import ValidationError
from pymongo.errors import PyMongoError

from services.scorer.attempts import Busy, Claimed
from services.scorer.decisions import Decision, Defer, Drop, Finish, Hold, Retry, Spent
from services.scorer.scoring import (
    DUE_SLACK,
    Clock,
    ScorerDeps,
    cancelled_as_noted,
    recorded_decision,
    score_text,
)
from shared.batched_publish import EventBatcher
from shared.bus import publish_command
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import (
    Phase,
    ScoreText,
    TaskError,
    TaskEvent,
    TaskFailed,
    event_sequence,
    new_id,
)
from shared.database_errors import transient_database_error
from shared.runtime import (
    LETTER_DEADLINE_S,
    keep_dead_lettering,
    keep_publishing,
    keep_trying_database,
    wait_for_claim,
)
from shared.topology import (
    ATTEMPTS_HEADER,
    EARLIER_DELIVERIES_HEADER,
    SCORE_REQUESTS,
    carried_deliveries,
    deliveries_lost,
)

log = logging.getLogger("scorebox.scorer")
CRASHES_HEADER = "x-scorebox-crashes"
# Marks a copy handed back from the crash limit (`_at_crash_limit`): it comes back to the
# give-up, never to the model. Its own mark, not its count against the limit: a limit
# lowered in a deploy gave up at arrival copies that had one more try coming (a review).
AT_CRASH_LIMIT_HEADER = "x-scorebox-at-crash-limit"
UNSTARTED_RESETS_HEADER = "x-scorebox-unstarted-resets"
# On the fresh copy of a never-claimed message sent at its delivery limit, that copy alone.
REPLACES_LOST_HEADER = "x-scorebox-replaces-lost"
# Times a message whose attempt was never claimed reaches the delivery limit and is sent again
# with its count cleared: with the default limit, 20 deliveries lost before a give-up.
UNSTARTED_RESETS = 3
# How long a delivery at a limit waits out a database that is away, each read or write,
# before it is handed back (`_handed_back`): held for the outage, it came back counted once
# more, past the limit, when its connection dropped or the broker's consumer timeout struck.
LIMIT_DATABASE_WAIT_S = 10.0
# Give-ups refused this many times (the attempt claimed or decided meanwhile, each time) go
# ahead unrecorded: a message that kills its consumers must stop.
GIVE_UP_TRIES = 3
CRASH_RETRY_DELAY = timedelta(seconds=5)


@dataclass(frozen=True)
class BrokerActions:
    """Carries out decisions on the broker; every publish awaits its confirm, and one the
    broker does not confirm is tried again while the delivery is held (`keep_publishing`)."""

    broker: RabbitBroker
    timeout_s: float
    clock: Clock
    # Outcomes published together while a publish awaits its confirm (1: each alone).
    outcome_batch_max: int = 1
    # How long a copy to the DLQ is tried before the delivery is returned as failed instead.
    letter_deadline_s: float = LETTER_DEADLINE_S
    _events: EventBatcher = field(init=False)

    def __post_init__(self) -> None:
        batcher = EventBatcher(
            self.broker, timeout=self.timeout_s, max_batch=self.outcome_batch_max
        )
        object.__setattr__(self, "_events", batcher)

    async def _confirmed(self, what: str, publish: Callable[[], Awaitable[object]]) -> None:
        await keep_publishing(publish, what=what)

    async def carry_out(self, decision: Decision, message: Delivery) -> bool | None:
        """Carry `decision` out; for a give-up that dead-letters, whether its letter is in
        the DLQ (False: the broker refused it, see `dead_letter`), else None."""
        lettered = None
        match decision:
            case Finish(event=event, dead_letter_error=error):
                if error is not None:
                    # Only the metrics and `scorebox dlq list` told of it (a walkthrough).
                    log.warning("%s dead-lettered: %s", event.task_id, error)
                    lettered = await self.dead_letter(message, error)
                await self._event(event)
            case Retry(event=event, next_command=next_command):
                await self._confirmed(
                    "the next attempt",
                    lambda: publish_command(
                        self.broker,
                        next_command,
                        timeout=self.timeout_s,
                        now=self.clock(),
                        sent_again=True,
                    ),
                )
                await self._event(event)
            case Defer(command=command, retry_due_later=later):
                await self.resend(command, headers=_carried_headers(message))
                if later is not None:
                    await self._told_best_effort(later)
            case Drop(reason=reason):
                log.debug("dropping a delivery: %s", reason)
        return lettered

    async def _event(self, event: TaskEvent) -> None:
        await self._confirmed(event.routing_key, lambda: self._events.publish(event))

    async def _told_best_effort(self, event: TaskEvent) -> None:
        """Publish `event` once, unconfirmed publishes logged: a later due time told again
        (`Defer.retry_due_later`) corrects a status, and holding the delivery for it while
        the broker refuses publishes would hold the copy's put-off for nothing; the status
        then reads the earlier time, as it did before it was told."""
        try:
            await self._events.publish(event)
        except Exception as error:  # noqa: BLE001 - best effort: the status reads the old time
            log.warning("%s of %s not published: %r", event.routing_key, event.task_id, error)

    async def resend(self, command: ScoreText, *, headers: dict[str, Any]) -> None:
        await self._confirmed(
            "a command",
            lambda: publish_command(
                self.broker,
                command,
                timeout=self.timeout_s,
                now=self.clock(),
                headers=headers,
                sent_again=True,
            ),
        )

    async def dead_letter(self, message: Delivery, error: str) -> bool:
        """Copy the delivery to its DLQ: True once the broker confirmed the copy. A copy the
        broker refuses for `letter_deadline_s` returns the delivery as failed instead
        (`keep_dead_lettering`; False), counted towards the queue's delivery limit: the
        handler goes on (a give-up's `task.failed` is published all the same, its decision
        recorded), and the ack it ends with is then no frame, a `Delivery` being settled
        once. A copy that comes back carries the decision out again."""
        return await keep_dead_lettering(
            self.broker,
            SCORE_REQUESTS,
            message,
            error=error,
            timeout=self.timeout_s,
            headers=_carried_headers(message),
            letter_deadline_s=self.letter_deadline_s,
        )

    async def fail_task(self, failed: TaskEvent) -> None:
        await self._event(failed)


def _given_up(command: ScoreText, reason: str, spent: Spent | None, *, now: datetime) -> Finish:
    """The decision a give-up records: the task failed, its message dead-lettered; metered
    with what the generation's earlier attempts were billed (`spent`): their retries
    published nothing metered, this is its outcome."""
    error = TaskError(code="internal_error", message=reason, retryable=False)
    return Finish(_failure(command, error, spent=spent, now=now), dead_letter_error=reason)


def _failure(
    command: ScoreText, error: TaskError, *, spent: Spent | None, now: datetime
) -> TaskFailed:
    billed: dict[str, Any] = {}
    if spent is not None:
        billed = {"usage": spent.usage, "model": spent.model}
    return TaskFailed(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        sequence=event_sequence(
            generation=command.generation, attempt=command.attempt, phase=Phase.TERMINAL
        ),
        attempt=command.attempt,
        generation=command.generation,
        submitted_at=command.submitted_at,
        api_key_id=command.api_key_id,
        error=error,
        dead_lettered=True,
        has_callback=command.callback_url is not None,
        callback_url=command.callback_url,
        occurred_at=now,  # the scorer's clock: the task's end as the status dates it
        **billed,
    )


def _carried_headers(message: Delivery) -> dict[str, Any]:
    """The headers a copy of the delivery's own command takes along (sent again, or
    dead-lettered), its deliveries counted so far included. Never a next attempt's."""
    # The copy at the limit's marker too: sent on by a scorer stopping, a database away or a
    # rate-limit put-off, it lost it (and carries no count), and was dropped where its lost
    # predecessor still held the attempt (found in review).
    keep = (
        CRASHES_HEADER,
        AT_CRASH_LIMIT_HEADER,
        ATTEMPTS_HEADER,
        UNSTARTED_RESETS_HEADER,
        REPLACES_LOST_HEADER,
    )
    headers = {key: value for key, value in message.headers.items() if key in keep}
    return headers | carried_deliveries(message.headers)


def subscribe_scorer(
    broker: ScoreboxBroker,
    deps: ScorerDeps,
    actions: BrokerActions,
    *,
    crash_limit: int,
    starts_after: Callable[[], Awaitable[object]] | None = None,
) -> None:
    @consume(broker, SCORE_REQUESTS.queue, starts_after=starts_after)
    async def on_score_requested(message: Delivery) -> None:
        try:
            command = ScoreText.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("dead-lettering an unreadable score.requested: %s", error)
            lettered = await actions.dead_letter(message, f"unreadable score.requested: {error}")
            await message.ack()
            deps.metrics.count_dead_lettered(lettered)
            return
        deliveries = deliveries_lost(message.headers)
        if deliveries >= SCORE_REQUESTS.delivery_limit:
            await _at_delivery_limit(command, message, deps, actions, deliveries)
            await message.ack()
            return
        if message.headers.get(AT_CRASH_LIMIT_HEADER):
            # A copy handed back at the crash limit: it looks again, never scores.
            await _at_crash_limit(command, message, deps, actions, crashes=_crashes_before(message))
            await message.ack()
            return
        redelivered = _handed_out_before(message)
        lost = asyncio.Event()
        try:
            # Losing the broker connection cancels this handler. The decision, with its model
            # call, is shielded: it completes and is recorded, and the redelivery replays it
            # instead of calling the model a second time once the claim's lease has expired.
            # One still waiting for a model slot then starts nothing (`lost`).
            decision = await asyncio.shield(
                deps.decisions.start(
                    _decide(command, deps, actions.clock, redelivered=redelivered, lost=lost)
                )
            )
        except asyncio.CancelledError:
            lost.set()
            raise
        except Exception as error:
            if transient_database_error(error):
                log.warning("MongoDB unavailable while scoring %s: %r", command.task_id, error)
                await _retry_later(command, message, actions, count_crash=False)
                deps.metrics.count_resent()
            else:  # a write the database refuses for good included: counted, not for ever
                log.exception("scoring %s crashed", command.task_id)
                await _after_crash(command, message, deps, actions, crash_limit=crash_limit)
        else:
            letter_in_dlq = await actions.carry_out(decision, message)
            deps.metrics.count_decision(decision, lettered=letter_in_dlq)
        await message.ack()


def _handed_out_before(message: Delivery) -> bool:
    """Whether this copy was handed out before, or stands in for one that was: a copy
    carrying deliveries lost (sent again by a scorer whose database was away, or that was
    stopping), or the copy sent at the delivery limit, which replaces a lost delivery. The
    lost delivery's handler may still hold the attempt here: dropped as a duplicate of it,
    the copy left nothing behind once the lost one gave up its turn (found in review, first
    for the copy at the limit, then for copies carrying their count)."""
    if deliveries_lost(message.headers) > 0 or message.redelivered:
        return True
    return bool(message.headers.get(REPLACES_LOST_HEADER))


async def _at_delivery_limit(
    command: ScoreText,
    message: Delivery,
    deps: ScorerDeps,
    actions: BrokerActions,
    deliveries: int,
) -> None:
    """Carry the attempt's recorded decision out again, if it has one (the connection was lost
    after recording it, before or while carrying it out); give the message up otherwise.
    `deliveries`: the deliveries its consumer lost, counted across the copies sent again.

    Giving up on a decided attempt published `task.failed` for a task whose result was
    stored, or next to the retry it had scheduled. Giving up on one never claimed failed
    tasks that had only waited in the prefetch of a consumer whose connection dropped.

    Never held across an open-ended wait (another claim's lease, a database away): handed
    back instead (`_handed_back`)."""
    copy_headers = _carried_headers(message)
    try:
        resets = int(message.headers.get(UNSTARTED_RESETS_HEADER, 0))
        if resets < UNSTARTED_RESETS and await _never_claimed(command, deps):
            await _sent_again_afresh(command, message, deps, actions, resets=resets + 1)
            return
        carried = int(message.headers.get(EARLIER_DELIVERIES_HEADER, 0))
        reason = (
            f"its consumer died or lost its connection holding it {deliveries} times "
            f"({carried} of them on earlier copies it was sent again as; "
            f"delivery limit {SCORE_REQUESTS.delivery_limit})"
        )
        await _settle_or_give_up(command, message, deps, actions, reason, copy_headers=copy_headers)
    except PyMongoError as error:
        await _handed_back_while_database_away(command, deps, actions, copy_headers, error)


async def _never_claimed(command: ScoreText, deps: ScorerDeps) -> bool:
    """Whether no claim of the command's attempt was ever written: nothing stored for the task,
    or only an earlier attempt or generation. A database that refuses the read for good says
    no (the limit's usual path); one away past `LIMIT_DATABASE_WAIT_S` raises."""
    try:
        held = await _at_limit_database(
            lambda: deps.attempts.find(command.task_id),
            what=f"reading the claim of {command.task_id} at its delivery limit",
        )
    except PyMongoError as error:
        if transient_database_error(error):
            raise
        return False
    if held is None:
        return True
    return (held["generation"], held["attempt"]) < (command.generation, command.attempt)


async def _sent_again_afresh(
    command: ScoreText, message: Delivery, deps: ScorerDeps, actions: BrokerActions, resets: int
) -> None:
    """Send the command again with its count of lost deliveries cleared; the caller acks it."""
    log.warning(
        "%s reached its delivery limit never claimed (lost waiting, not working): "
        "sent again with its count cleared (%d of %d)",
        command.task_id,
        resets,
        UNSTARTED_RESETS,
    )
    headers = {
        key: value
        for key, value in _carried_headers(message).items()
        if key != EARLIER_DELIVERIES_HEADER
    }
    again = command.model_copy(update={"message_id": new_id()})
    replacing = {UNSTARTED_RESETS_HEADER: resets, REPLACES_LOST_HEADER: True}
    await actions.resend(again, headers=headers | replacing)
    deps.metrics.count_resent()


async def _settle_or_give_up(
    command: ScoreText,
    message: Delivery,
    deps: ScorerDeps,
    actions: BrokerActions,
    reason: str,
    *,
    copy_headers: dict[str, Any],
) -> None:
    """Carry out the attempt's recorded decision; give the message up when nothing was
    decided; hand it back (`copy_headers` on its copy) while another claim holds the attempt.
    A give-up refused (the attempt was claimed or decided in between) looks at the attempt
    again."""
    for _ in range(GIVE_UP_TRIES):
        recorded = await _settled_decision(command, deps)
        if isinstance(recorded, Busy):
            due = recorded.until + DUE_SLACK
            await _handed_back(command, deps, actions, copy_headers, due=due, why="claimed")
            return
        if recorded is not None:
            log.warning("%s given up on: carrying its recorded decision out", command.task_id)
            lettered = await actions.carry_out(recorded, message)
            deps.metrics.count_decision(recorded, lettered=lettered)
            return
        try:
            if await _give_up(command, message, deps, actions, reason):
                return
        except HeldHere:
            await _handed_back_while_held_here(command, deps, actions, copy_headers)
            return
    log.error("%s: its give-up was refused %d times; not recorded", command.task_id, GIVE_UP_TRIES)
    unrecorded = await _unrecorded_give_up(command, deps, reason)
    await _dead_letter_and_fail(message, deps, actions, unrecorded, reason)


async def _settled_decision(
    command: ScoreText, deps: ScorerDeps
) -> Finish | Retry | Drop | Busy | None:
    """The attempt's recorded decision at the delivery limit (or at the crash limit, another
    claim holding the attempt); Busy while its claim holds, None once its lease ended with
    nothing decided (its worker died).

    A claim that holds may be the shielded decision of a delivery whose connection dropped,
    with its model call still running: given up then, its decision was recorded a moment
    later and carried out by nobody (the task read failed, its result stored). Waited for
    with the delivery held (up to the lease, 90 s by default), the delivery came back past
    the limit if its connection dropped meanwhile: the caller hands it back instead."""
    standing = await _recorded_decision_at_limit(command, deps)
    if isinstance(standing, Busy) and standing.until <= deps.clock():
        return None
    return standing


async def _recorded_decision_at_limit(
    command: ScoreText, deps: ScorerDeps
) -> Finish | Retry | Drop | Busy | None:
    """`recorded_decision`, a database that is away waited out up to `LIMIT_DATABASE_WAIT_S`
    (then raised, for the delivery to be handed back): taken for "nothing decided", a
    database away at that moment failed a task whose result may be stored. A read the
    database refuses for good is taken for nothing decided: held, the delivery stayed so for
    ever; given up, the message stops."""
    try:
        return await _at_limit_database(
            lambda: recorded_decision(command, deps=deps),
            what=f"reading the recorded decision of {command.task_id} at its delivery limit",
        )
    except PyMongoError as error:
        if transient_database_error(error):
            raise
        log.exception("%s: its recorded decision cannot be read; taken for none", command.task_id)
        return None


async def _handed_back(
    command: ScoreText,
    deps: ScorerDeps,
    actions: BrokerActions,
    copy_headers: dict[str, Any],
    *,
    due: datetime,
    why: str,
) -> None:
    """A delivery at a limit that would wait (another claim holds its attempt, or the
    database is away) is sent again as a fresh copy due at `due`, down the wait ladder,
    carrying its deliveries counted so far unchanged (`copy_headers`); the caller acks it.

    It used to be held meanwhile: for the other claim's lease (90 s by default, longer than a
    stop's grace period), for a database outage without end. A connection dropped under it
    (or a stop, or the broker's consumer timeout closing its channel) returned it counted
    once more, and a delivery at the limit by RabbitMQ's own count was dead-lettered by the
    queue's `x-delivery-limit`, without a give-up recorded or `task.failed` published; the
    other claim's decision, recorded a moment later, was carried out by nobody. The copy
    comes back at the limit and looks again. The delivery is held until the broker confirms
    the copy: a connection that drops first leaves it to come back, never lost."""
    log.info("%s: at its limit, %s; sent again, its count kept", command.task_id, why)
    again = command.model_copy(update={"not_before": due, "message_id": new_id()})
    await actions.resend(again, headers=copy_headers)
    deps.metrics.count_resent()


class HeldHere(Exception):
    """Another delivery of this process holds the attempt a limit would give up: its copy
    is handed back to look again (`_handed_back_while_held_here`)."""


async def _handed_back_while_held_here(
    command: ScoreText, deps: ScorerDeps, actions: BrokerActions, copy_headers: dict[str, Any]
) -> None:
    """`_handed_back`, due shortly, while another delivery of this process holds the attempt
    (waiting for a model slot or its turn, or calling): not counted as a refused give-up,
    whose last try gave the message up unrecorded, `task.failed` next to the holder's call.
    Back, it finds the holder's claim (`Busy`), its decision, or the attempt let go."""
    due = deps.clock() + CRASH_RETRY_DELAY
    why = "another delivery of this process holds its attempt"
    await _handed_back(command, deps, actions, copy_headers, due=due, why=why)


async def _handed_back_while_database_away(
    command: ScoreText,
    deps: ScorerDeps,
    actions: BrokerActions,
    copy_headers: dict[str, Any],
    error: PyMongoError,
) -> None:
    """`_handed_back`, due shortly, for a database away past `LIMIT_DATABASE_WAIT_S`; any
    other database error is raised (its callers took those for nothing decided already)."""
    if not transient_database_error(error):
        raise error
    log.warning("MongoDB unavailable at the limit of %s: %r", command.task_id, error)
    due = deps.clock() + CRASH_RETRY_DELAY
    await _handed_back(command, deps, actions, copy_headers, due=due, why="the database away")


async def _at_limit_database[T](action: Callable[[], Awaitable[T]], *, what: str) -> T:
    """`keep_trying_database` for a delivery at a limit: the last error raised once the wait
    would pass `LIMIT_DATABASE_WAIT_S`, for the delivery to be handed back."""
    return await keep_trying_database(action, what=what, give_up_after_s=LIMIT_DATABASE_WAIT_S)


async def _decide(
    command: ScoreText,
    deps: ScorerDeps,
    clock: Clock,
    *,
    redelivered: bool,
    lost: asyncio.Event | None = None,
) -> Decision:
    """`score_text`, holding a redelivery (unacknowledged) while another claim lasts."""
    decision = await score_text(command, deps=deps, redelivered=redelivered, lost=lost)
    while isinstance(decision, Hold) and not (lost is not None and lost.is_set()):
        await wait_for_claim(decision.until, clock)
        decision = await score_text(command, deps=deps, redelivered=True, lost=lost)
    return decision


async def _retry_later(
    command: ScoreText, message: Delivery, actions: BrokerActions, *, count_crash: bool
) -> None:
    headers = _carried_headers(message)
    if count_crash:
        headers[CRASHES_HEADER] = int(headers.get(CRASHES_HEADER, 0)) + 1
    due = command.model_copy(
        update={"not_before": actions.clock() + CRASH_RETRY_DELAY, "message_id": new_id()}
    )
    await actions.resend(due, headers=headers)


async def _after_crash(
    command: ScoreText,
    message: Delivery,
    deps: ScorerDeps,
    actions: BrokerActions,
    *,
    crash_limit: int,
) -> None:
    """Send the message again later, or give it up at the crash limit."""
    crashes = _crashes_before(message) + 1
    if crashes < crash_limit:
        await _retry_later(command, message, actions, count_crash=True)
        deps.metrics.count_resent()
        return
    await _at_crash_limit(command, message, deps, actions, crashes=crashes)


def _crashes_before(message: Delivery) -> int:
    return int(message.headers.get(CRASHES_HEADER, 0))


async def _at_crash_limit(
    command: ScoreText, message: Delivery, deps: ScorerDeps, actions: BrokerActions, *, crashes: int
) -> None:
    """Give the message up, or carry out the decision another claim recorded meanwhile. Its
    copy handed back (another claim holding the attempt, the database away) carries
    `crashes`, so that it comes back here rather than to the model."""
    reason = f"the scorer crashed {crashes} times on this message"
    copy_headers = _carried_headers(message) | {CRASHES_HEADER: crashes, AT_CRASH_LIMIT_HEADER: 1}
    try:
        # The attempt's claim is this process's own, as a rule: given up at once, not once
        # its lease has ended (which `_settle_or_give_up` looks for).
        if not await _give_up(command, message, deps, actions, reason):
            await _settle_or_give_up(
                command, message, deps, actions, reason, copy_headers=copy_headers
            )
    except HeldHere:
        await _handed_back_while_held_here(command, deps, actions, copy_headers)
    except PyMongoError as error:
        await _handed_back_while_database_away(command, deps, actions, copy_headers, error)


async def _give_up(
    command: ScoreText, message: Delivery, deps: ScorerDeps, actions: BrokerActions, reason: str
) -> bool:
    """Record the give-up as the attempt's decision, then dead-letter the message and fail
    the task; False, nothing done, when the attempt could not be claimed for it (another
    worker's claim holds it, or it was decided meanwhile).

    Recorded, a later copy of the attempt (the gateway's outbox sweep, a retry replayed, a
    publish repeated after a lost confirm) carries the failure out again. Unrecorded, the
    claim stayed `running`: a copy claimed it once its lease ran out, called the model and
    published a completion with the failure's sequence, which the projection dropped."""
    given_up = await _recorded_give_up(command, deps, reason)
    if given_up is None:
        return False
    await _dead_letter_and_fail(message, deps, actions, given_up, reason)
    return True


async def _dead_letter_and_fail(
    message: Delivery, deps: ScorerDeps, actions: BrokerActions, given_up: Finish, reason: str
) -> None:
    if given_up.dead_letter_error is None:  # its client cancelled it: nothing to replay
        log.error(
            "%s given up, cancelled by its client, not dead-lettered: %s",
            given_up.event.task_id,
            reason,
        )
        await actions.fail_task(given_up.event)
        return
    log.error("dead-lettering %s: %s", given_up.event.task_id, reason)
    lettered = await actions.dead_letter(message, reason)
    await actions.fail_task(given_up.event)
    deps.metrics.count_dead_lettered(lettered)


async def _recorded_give_up(command: ScoreText, deps: ScorerDeps, reason: str) -> Finish | None:
    """The give-up, once recorded as the attempt's decision (None: refused).

    The database away is waited out up to `LIMIT_DATABASE_WAIT_S`, then raised (the delivery
    is handed back). Any other failure to record it gives the message up unrecorded: a
    message that crashes its handler must stop."""
    try:
        return await _claimed_and_given_up(command, deps, reason)
    except HeldHere:
        raise
    except Exception as error:
        if transient_database_error(error):
            raise
        log.exception("%s: its give-up could not be recorded", command.task_id)
        return await _unrecorded_give_up(command, deps, reason)


async def _unrecorded_give_up(command: ScoreText, deps: ScorerDeps, reason: str) -> Finish:
    """A give-up the database would not record. It carries what the generation's earlier
    attempts were billed only once that is marked published: left unmarked, the record
    still read "no outcome", a DLQ replay's claim took the tokens over, and the replay's
    outcome billed them again (review of usage). Unmarked, it carries none, and a replay
    bills them once; without a replay they go unbilled (at most once)."""
    spent = await _spent_before(command, deps)
    if spent is not None and not await deps.attempts.note_spent_published(command):
        log.warning("%s: its earlier attempts' tokens left to a replay", command.task_id)
        spent = None
    return _given_up(command, reason, spent, now=deps.clock())


async def _claimed_and_given_up(command: ScoreText, deps: ScorerDeps, reason: str) -> Finish | None:
    """Claim the attempt as `score_text` does (claimable, or a claim of ours none of our
    deliveries works on), then record the give-up under that claim. The claim takes over
    what an older generation it replaces was billed (`Attempts.claim`), and `spent_before`
    reads it under the claim. `HeldHere` when another delivery of this process holds the
    attempt: it claimed all the same, and the holder, claiming its own way after it, took
    that claim over as a stale one of this process's, called the model, and both decisions
    were recorded and carried out (`task.failed` dead-lettered, then `task.completed`; a
    review)."""
    attempt = (command.task_id, command.generation, command.attempt)
    with deps.in_hand.holding(attempt) as only_here:
        if not only_here:
            raise HeldHere
        claim = await _at_limit_database(
            lambda: deps.attempts.claim(
                command, now=deps.clock(), lease=deps.lease, owner=deps.owner, reclaim_own=True
            ),
            what=f"claiming {command.task_id} to give it up",
        )
        if not isinstance(claim, Claimed):
            return None
        given_up = await _given_up_unless_cancelled(command, claim, reason, deps)
        recorded = await _at_limit_database(
            lambda: deps.attempts.decide(
                command,
                given_up,
                now=deps.clock(),
                raw_output=None,
                owner=deps.owner,
                claim=claim,
            ),
            what=f"recording the give-up of {command.task_id}",
        )
    return given_up if recorded else None


async def _given_up_unless_cancelled(
    command: ScoreText, claim: Claimed, reason: str, deps: ScorerDeps
) -> Finish:
    """The give-up of a claimed attempt; its cancellation, without a dead letter, when a
    client cancelled while an earlier delivery called the model. Given up to the DLQ, it
    was scored after all by a replay of it (review of cancellation). One read, waited for
    while the database is away as `_spent_before` is; should it fail otherwise, a give-up
    unmetered."""
    try:
        before = await _at_limit_database(
            lambda: deps.attempts.before_the_call(command, claim),
            what=f"reading what earlier attempts of {command.task_id} were billed",
        )
    except Exception as error:  # giving the task up must not fail on its metering
        if transient_database_error(error):
            raise
        log.exception("%s: what its earlier attempts were billed is lost", command.task_id)
        return _given_up(command, reason, None, now=deps.clock())
    if before.cancel_requested_at is None:
        return _given_up(command, reason, before.spent, now=deps.clock())
    return cancelled_as_noted(
        command, before.cancel_requested_at, spent=before.spent, now=deps.clock()
    )


async def _spent_before(command: ScoreText, deps: ScorerDeps) -> Spent | None:
    """`Attempts.spent_before`, waited for while the database is away, up to
    `LIMIT_DATABASE_WAIT_S` (then raised: the delivery is handed back, as at the delivery
    limit); None should reading it fail otherwise."""
    try:
        return await _at_limit_database(
            lambda: deps.attempts.spent_before(command),
            what=f"reading what earlier attempts of {command.task_id} were billed",
        )
    except Exception as error:  # giving the task up must not fail on its metering
        if transient_database_error(error):
            raise
        log.exception("%s: what its earlier attempts were billed is lost", command.task_id)
        return None
