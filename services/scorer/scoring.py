"""`score_text`: the scorer's handler — claim, call the model (announcing a slow call),
decide.

Plain async code: it knows nothing of FastStream or HTTP. The consumer adapter carries out
the returned decision on the broker and acks.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import datetime, timedelta

from pymongo.errors import PyMongoError

from services.scorer.attempts import (
    Attempts,
    Busy,
    CancelContended,
    Cancelled,
    Claimed,
    Decided,
    Superseded,
)
from services.scorer.batch_cancels import CancelledBatches
from services.scorer.decisions import (
    Decision,
    Defer,
    Drop,
    Finish,
    Hold,
    Retry,
    Spent,
    add_usage,
    cancelled,
    is_cancellation,
)
from services.scorer.detached import Detached
from services.scorer.errors import (
    ModelRateLimited,
    PermanentError,
    ScoringError,
    TransientError,
)
from services.scorer.metrics import ScorerMetrics
from services.scorer.model import ModelVerdict, ScoreModel, ScoringRequest
from services.scorer.slots import ModelSlots, SlotsClosed
from services.scorer.throttle import ModelThrottle, PutOff, Turn
from shared.backoff import capped_exponential_s, jittered_s
from shared.contracts import (
    CancelTask,
    Phase,
    ScoreText,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    TaskRetrying,
    TaskStarted,
    Usage,
    event_sequence,
    new_id,
)
from shared.in_hand import InHand
from shared.runtime import HOLD_POLL_S, keep_trying_database

log = logging.getLogger("scorebox.scorer")

Announce = Callable[[TaskEvent], Awaitable[None]]
Clock = Callable[[], datetime]
DUE_SLACK = timedelta(milliseconds=500)
# The longest `Retry-After` honoured: a provider's hint beyond it (a quota gone for good, a
# broken header such as 1e12, which would overflow the date) would park the task for ever.
MAX_RETRY_AFTER_S = 24 * 3600.0


@dataclass(frozen=True)
class RetryPolicy:
    """Exponential back-off with jitter; a `Retry-After` from the model is a floor, up to
    `MAX_RETRY_AFTER_S`."""

    base_s: float
    cap_s: float
    # Attempts a rate limit (429) may end without counting against the task's max_attempts.
    rate_limit_retries: int = 20

    def delay_s(self, attempt: int, retry_after_s: float | None, rng: random.Random) -> float:
        backoff = capped_exponential_s(attempt, base_s=self.base_s, cap_s=self.cap_s)
        return max(jittered_s(backoff, rng), min(retry_after_s or 0.0, MAX_RETRY_AFTER_S))


@dataclass(frozen=True)
class ScorerDeps:
    attempts: Attempts
    model: ScoreModel
    announce: Announce
    clock: Clock
    lease: timedelta
    retry_policy: RetryPolicy
    rng: random.Random
    owner: str  # this process, as its claims name it (unique per process)
    # At most SCORER_CONCURRENCY attempts claim and call the model at once.
    model_slots: ModelSlots
    # Pauses this process's model calls while the provider rate-limits it.
    throttle: ModelThrottle = field(default_factory=ModelThrottle)
    # `task.started` for an attempt still running after this long; zero announces at once.
    started_after: timedelta = timedelta(0)
    # The attempts deliveries of this process are claiming, calling the model for or
    # recording (task id, generation, attempt).
    in_hand: InHand[tuple[str, int, int]] = field(default_factory=InHand)
    # Every decision running, those whose delivery was lost included: the stop waits for them.
    decisions: Detached = field(default_factory=Detached)
    metrics: ScorerMetrics = field(default_factory=ScorerMetrics)
    # The batches cancelled that this replica heard of: their items are cancelled at delivery.
    cancelled_batches: CancelledBatches | None = None


def _sequence(command: ScoreText, phase: Phase) -> int:
    return event_sequence(generation=command.generation, attempt=command.attempt, phase=phase)


def _event_fields(command: ScoreText, phase: Phase, now: datetime) -> dict[str, object]:
    return {
        "task_id": command.task_id,
        "tenant_id": command.tenant_id,
        "sequence": _sequence(command, phase),
        "attempt": command.attempt,
        "generation": command.generation,
        "submitted_at": command.submitted_at,
        "occurred_at": now,
        "api_key_id": command.api_key_id,
    }


async def score_text(
    command: ScoreText,
    *,
    deps: ScorerDeps,
    redelivered: bool = False,
    lost: asyncio.Event | None = None,
) -> Decision:
    """Decide what one delivery of `score.requested` leads to, calling the model at most once
    per attempt across redeliveries and replicas.

    `redelivered`: a consumer was handed this message, or the delivery it is a copy of or
    stands in for, and lost it unsettled (its consumer died or lost its connection;
    `consumer._handed_out_before`); a busy claim then holds it rather than deferring.
    `lost`: set when the delivery was lost (its connection dropped) while this ran; a decision
    that had not yet reached a model slot then starts nothing.
    """
    now = deps.clock()
    if command.not_before is not None and command.not_before > now + DUE_SLACK:
        return Defer(command)
    attempt = (command.task_id, command.generation, command.attempt)
    with deps.in_hand.holding(attempt) as only_here:
        if not only_here:
            # No claim: it could land before the holder's, which would take it over as a
            # stale claim of this process (two model calls). A redelivery waits for the
            # holder: its handler may have been cancelled (the connection dropped) while
            # its shielded decision goes on, and nothing would carry that decision out.
            # Any other copy is dropped: the holder, or that redelivery, carries it out.
            if redelivered:
                return Hold(now + timedelta(seconds=HOLD_POLL_S))
            return Drop("another delivery in this process is working on this attempt")
        if (cancelled_now := await _cancelled_with_its_batch(command, deps)) is not None:
            return cancelled_now
        # Held by no other delivery here: a claim of this process on it is stale.
        try:
            return await _claim_and_decide(command, deps, redelivered, lost)
        except SlotsClosed:
            return _turned_away(command)


async def _cancelled_with_its_batch(command: ScoreText, deps: ScorerDeps) -> Finish | None:
    """The cancellation of the command's generation, recorded now, when its batch's
    cancellation names it (`services/scorer/batch_cancels.py`); None to go on as usual: not
    named, too late (`Attempts.cancel`), or the database away (its own `CancelTask` records
    it, or finds it too late, as it would have without the announcement)."""
    if deps.cancelled_batches is None:
        return None
    requested_at = deps.cancelled_batches.requested_at(command)
    if requested_at is None:
        return None
    try:
        outcome = await deps.attempts.cancel(
            _cancel_requested(command, requested_at), now=deps.clock()
        )
    except (PyMongoError, CancelContended) as error:
        # At DEBUG: the claim below meets the same outage and reports it; a batch's items
        # would each write a line of their own.
        log.debug(
            "%s: its batch's cancellation not applied at delivery: %r", command.task_id, error
        )
        return None
    if not isinstance(outcome, Cancelled) or not outcome.recorded_now:
        # Too late; or recorded before (by the item's own cancel, or a copy): the claim below
        # meets it and carries it out, or drops it if its consumer published it already.
        return None
    deps.metrics.cancelled_at_delivery.inc()
    return outcome.decision


def _turned_away(command: ScoreText) -> Defer:
    """The scorer is stopping and this delivery reached no model slot (nor a claim): it is
    sent again as a fresh copy, for another scorer or this one restarted, then acked.

    Left unacknowledged, it came back with one more delivery counted towards the queue's
    limit at every stop, as though its consumer had died on it: a redelivery waiting for a
    slot through a rolling deploy of several replicas reached the limit and was failed as
    poison. The copy carries the deliveries counted so far (`x-scorebox-earlier-deliveries`,
    added by the consumer to every copy it sends again), so a stop adds none and a real
    crash still adds one. Until the broker confirms the copy the delivery is held, and a
    stop that ends first leaves it to come back: never lost."""
    return Defer(command.model_copy(update={"message_id": new_id()}))


async def recorded_decision(
    command: ScoreText, *, deps: ScorerDeps
) -> Finish | Retry | Drop | Busy | None:
    """For a delivery past the queue's delivery limit: the attempt's recorded decision to
    carry out again (its effects may not have been), Drop when a newer attempt exists or that
    decision is a cancellation its consumer published, Busy while the attempt's claim holds
    (a decision may yet be recorded), None when nothing was decided (the caller gives up on
    the message)."""
    match await deps.attempts.standing(command):
        case Decided(decision=decision, published=published) if _decides(
            decision, command
        ) or _cancels_the_next(decision, command):
            # The attempt's own; or the cancellation that replaced its retry (noted during
            # its call), which this very delivery carried out, perhaps with its publish lost:
            # dropped, nothing was left to carry it out (found in review). A repeat is a no-op.
            kept = _unless_published_cancellation(decision, published=published)
            return await _replayed(kept, command, deps)
        case Decided(decision=decision) if _is_newer(decision, command):
            # A later attempt completed or failed: its own delivery carried that out. Given
            # up, this one published a second, failed outcome next to it.
            return Drop("a newer attempt of this task decided")
        case Decided():
            # An earlier attempt's, or an earlier generation's (a re-score or a replay that
            # reached the limit before any scorer claimed it): this one decided nothing. Its
            # recorded decision was carried out again and the new run was lost.
            return None
        case Superseded():
            return Drop("a newer attempt of this task exists")
        case Busy() as busy:
            return busy
        case _:
            return None


def _unless_published_cancellation(
    decision: Finish | Retry, *, published: bool
) -> Finish | Retry | Drop:
    """`decision`, or Drop for a cancellation its consumer published, as `_not_claimed` drops
    it: carried out again by a command reaching its delivery limit after its task was
    cancelled (days later, a delayed task's), it brought the task back into the status service
    after it had expired there, its webhook perhaps a second time (found in review)."""
    if published and is_cancellation(decision):
        return Drop("its cancellation was published when it was recorded")
    return decision


def _cancels_the_next(decision: Finish | Retry, command: ScoreText) -> bool:
    """Whether `decision` is the cancellation of the command's next attempt."""
    event = decision.event
    following = (command.generation, command.attempt + 1)
    return is_cancellation(decision) and (event.generation, event.attempt) == following


def _is_newer(decision: Finish | Retry, command: ScoreText) -> bool:
    event = decision.event
    return (event.generation, event.attempt) > (command.generation, command.attempt)


def _decides(decision: Finish | Retry, command: ScoreText) -> bool:
    """Whether `decision` is the one of the command's own attempt."""
    event = decision.event
    return (event.generation, event.attempt) == (command.generation, command.attempt)


async def _claim_and_decide(
    command: ScoreText, deps: ScorerDeps, redelivered: bool, lost: asyncio.Event | None
) -> Decision:
    """Claim the attempt and call the model in a model slot; record the decision after it.

    The claim's lease counts from the moment a slot is held and the provider's rate limit lets
    a call start (`services/scorer/throttle.py`), not from the delivery's arrival. A delivery
    lost while it waited for the slot (its copy redelivered, perhaps to another scorer) claims
    nothing: the slot goes to a delivery still in hand.
    """
    async with deps.model_slots.held():
        called = await _in_its_turn(command, deps, redelivered, lost)
    if isinstance(called, PutOff):
        return await _put_off(command, called, deps)
    if not isinstance(called, Called):
        return called
    return await _recorded(command, called, deps)


async def _in_its_turn(
    command: ScoreText, deps: ScorerDeps, redelivered: bool, lost: asyncio.Event | None
) -> Called | Decision | PutOff:
    """In a model slot: the call once the throttle gives the delivery its turn, or PutOff
    when a pause outlasts what it may wait in hand (put off once the slot is let go: telling
    the status reads the database, `_put_off`)."""
    if (instead := await _not_to_call(command, deps, lost, "for a model slot")) is not None:
        return instead
    turn = await deps.throttle.wait_turn(
        deps.model_slots.closing,
        text_key=hash(command.text),
        tenant_key=command.tenant_id,
        model=command.model,
    )
    if isinstance(turn, PutOff):
        return turn
    try:
        waited = "out a rate-limit pause"
        if (instead := await _not_to_call(command, deps, lost, waited)) is not None:
            return instead
        return await _claim_and_call(command, deps, redelivered, turn)
    finally:
        deps.throttle.done(turn)


async def _not_to_call(
    command: ScoreText, deps: ScorerDeps, lost: asyncio.Event | None, waited: str
) -> Decision | None:
    """What a delivery that `waited` (for a slot, or out a rate-limit pause) does instead of
    its call: nothing when its delivery was lost meanwhile, or its batch's cancellation, heard
    meanwhile (the check on arrival found it not yet: a delivery in hand waits behind the
    calls under way, the prefetch being twice the slots, and a pause holds every slot's
    delivery in `wait_turn`; each item of a cancelled batch waiting so was scored, found in a
    walkthrough: 16 of a 1,000-item batch cancelled a second after its 202). None: call."""
    if lost is not None and lost.is_set():
        return Drop(f"its delivery was lost while it waited {waited}")
    return await _cancelled_with_its_batch(command, deps)


@dataclass(frozen=True)
class Called:
    """The model was called under a claim taken at `claimed_at` (or, for a cancellation
    requested meanwhile, would have been: `decision` is then that cancellation)."""

    decision: Finish | Retry
    raw_output: str | None
    claimed_at: datetime
    claim: Claimed


async def _claim_and_call(
    command: ScoreText, deps: ScorerDeps, redelivered: bool, turn: Turn
) -> Called | Decision:
    now = deps.clock()
    claim = await deps.attempts.claim(
        command, now=now, lease=deps.lease, owner=deps.owner, reclaim_own=True
    )
    if not isinstance(claim, Claimed):
        return await _replayed(_not_claimed(claim, command, redelivered), command, deps)
    # Read before the model is called: failing after it, the call would be made again.
    before = await deps.attempts.before_the_call(command, claim)
    earlier = before.spent
    if before.cancel_requested_at is not None:
        # The client cancelled while an earlier attempt called the model, which then ended in
        # a retry: this attempt's call has not started, so it is cancelled, not made.
        cancel = cancelled_as_noted(command, before.cancel_requested_at, spent=earlier, now=now)
        return Called(cancel, None, now, claim)
    started = TaskStarted.model_validate(_event_fields(command, Phase.STARTED, now))
    decision, raw_output = await _call_model_announcing(command, started, deps, earlier, turn)
    return Called(decision, raw_output, claimed_at=now, claim=claim)


def _not_claimed(
    claim: Superseded | Busy | Decided, command: ScoreText, redelivered: bool
) -> Decision:
    match claim:
        case Superseded():
            return Drop("a newer attempt of this task exists")
        case Busy(until=until):
            if redelivered:
                return Hold(until)
            # Past the slack a due copy is taken with: sent back early, by less than the
            # shortest wait tier, it found the claim still held and spun until then.
            due = until + DUE_SLACK
            return Defer(command.model_copy(update={"not_before": due, "message_id": new_id()}))
        case Decided(decision=decision, published=True) if is_cancellation(decision):
            # Its consumer published it: published again when a delayed task came due (days
            # later), it brought the task back into the status service after it had expired
            # there, and its webhook perhaps a second time (found in review).
            return Drop("its cancellation was published when it was recorded")
        case Decided(decision=decision) if _is_newer(decision, command) and not (
            _cancels_the_next(decision, command)
        ):
            # A later attempt's outcome, which its own delivery carries out: a stale copy of
            # an earlier attempt carried it out again, a given-up one dead-lettered once more
            # (a review), as `recorded_decision` drops it at the limit.
            return Drop("a newer attempt of this task decided")
        case Decided(decision=decision):
            return decision


async def _replayed[D: Decision](decision: D, command: ScoreText, deps: ScorerDeps) -> D | Finish:
    """A recorded decision about to be carried out again: the attempt's own retry is looked at
    for a cancellation noted meanwhile, as when it was decided (`_unless_cancelled_meanwhile`).
    A process that died between recording the retry and that look left it to every replay,
    and the task read `retrying`, its tenant's slot held until the retry was due (a day,
    after a long `Retry-After`), after a cancel answered 202 (a review)."""
    if isinstance(decision, Retry) and _decides(decision, command):
        checked = await _unless_cancelled_meanwhile(command, decision, deps)
        return checked if isinstance(checked, Finish) else decision
    if isinstance(decision, Finish) and decision.dead_letter_error and _decides(decision, command):
        # Its give-up, lettered as a cancellation was noted (see `_recorded`): a redelivery
        # carried the letter out again (a re-read).
        unlettered = await _unlettered_if_cancelled_meanwhile(command, decision, deps)
        return unlettered if isinstance(unlettered, Finish) else decision
    return decision


async def _unless_cancelled_meanwhile(
    command: ScoreText, retry: Retry, deps: ScorerDeps
) -> Finish | Retry:
    """A retry recorded, or the cancellation of its next attempt when a client cancelled
    while this attempt called the model. Left for the next attempt's claim, the task read
    `retrying` and held its tenant's slot until the retry was due (hours, after a long
    Retry-After; found in review). The claim still checks: should this fail (the database
    away), the retry goes ahead and is cancelled there."""
    try:
        requested_at = await deps.attempts.cancel_requested_at(command)
        if requested_at is None:
            return retry
        cancel = await deps.attempts.cancel(
            _cancel_requested(command, requested_at), now=deps.clock()
        )
    except (PyMongoError, CancelContended) as error:
        log.warning("%s: a cancellation noted meanwhile not looked at: %r", command.task_id, error)
        return retry
    return cancel.decision if isinstance(cancel, Cancelled) else retry


async def _unlettered_if_cancelled_meanwhile(
    command: ScoreText, decision: Finish | Retry, deps: ScorerDeps
) -> Finish | Retry:
    """A give-up to the DLQ of an attempt whose call a client's cancellation came during:
    the failure stands, without its dead letter. Lettered, it was scored and billed after
    all by a replay of the DLQ (after an outage, say), as a generation the cancellation did
    not name (review of cancellation). The database away letters it, as before."""
    if not isinstance(decision, Finish) or decision.dead_letter_error is None:
        return decision
    try:
        requested_at = await deps.attempts.cancel_requested_at(command)
    except PyMongoError as error:
        log.warning("%s: a cancellation noted meanwhile not looked at: %r", command.task_id, error)
        return decision
    if requested_at is None:
        return decision
    log.info("%s: given up, cancelled during its call: not dead-lettered", command.task_id)
    return Finish(decision.event.model_copy(update={"dead_lettered": False}))


def cancelled_as_noted(
    command: ScoreText, requested_at: datetime, *, spent: Spent | None, now: datetime
) -> Finish:
    """The cancellation of `command`'s attempt that a client asked for at `requested_at`,
    while an earlier attempt called the model."""
    return cancelled(
        _cancel_requested(command, requested_at), attempt=command.attempt, spent=spent, now=now
    )


def _cancel_requested(command: ScoreText, requested_at: datetime) -> CancelTask:
    """The client's cancellation of the command's generation, as the gateway sent it."""
    return CancelTask(
        task_id=command.task_id,
        tenant_id=command.tenant_id,
        generation=command.generation,
        submitted_at=command.submitted_at,
        api_key_id=command.api_key_id,
        callback_url=command.callback_url,
        requested_at=requested_at,
        not_before=command.not_before,
        occurred_at=requested_at,
    )


async def _put_off(command: ScoreText, put_off: PutOff, deps: ScorerDeps) -> Defer:
    """Sent down the wait ladder until shortly before the rate-limit pause ends (spread, so
    that the deliveries put off do not all come back at once); no attempt is spent.

    A retry's attempt put off past the time its `task.retrying` told (`next_attempt_at`)
    tells it again with the copy's due time (`_retry_due_later`): the task's status read
    that first time, long past, for as long as the pause lasted, and a client polling could
    not tell when the next attempt would come."""
    due = deps.clock() + timedelta(seconds=deps.throttle.back_in_s(put_off, deps.rng))
    copy = command.model_copy(update={"not_before": due, "message_id": new_id()})
    return Defer(copy, retry_due_later=await _retry_due_later(command, due, deps))


async def _retry_due_later(
    command: ScoreText, due: datetime, deps: ScorerDeps
) -> TaskRetrying | None:
    """The `task.retrying` whose next attempt `command` is, with `due` as its next attempt's
    time; None for a first attempt (its task reads `queued`, with no time to correct), when
    the retry told a time no earlier than `due`, or when it no longer stands (a cancellation
    recorded over it, a newer generation). The same event under the same sequence: a status
    service applies it only as a later due time of the state it holds (`apply_task_event`),
    one of an earlier build as a duplicate (nothing). Best effort: a database away tells
    nothing (the put-off goes ahead; the claim meets the outage when the copy is back)."""
    if command.attempt <= 1:
        return None
    try:
        retry = await deps.attempts.retry_before(command)
    except Exception as error:  # noqa: BLE001 - best effort: an odd record must not crash it
        log.debug("%s: its later due time not told: %r", command.task_id, error)
        return None
    if retry is None or retry.next_attempt_at >= due:
        return None
    return retry.model_copy(update={"next_attempt_at": due, "message_id": new_id()})


async def _recorded(command: ScoreText, called: Called, deps: ScorerDeps) -> Decision:
    """The decision once recorded; a Drop when the attempt was taken over meanwhile."""
    decision = await _unlettered_if_cancelled_meanwhile(command, called.decision, deps)
    if await _record(command, replace(called, decision=decision), deps):
        if isinstance(decision, Retry):
            return await _unless_cancelled_meanwhile(command, decision, deps)
        # Again once recorded: a cancellation noted between the look and the record (the
        # call still `running`) was lettered all the same (re-read). The decision recorded
        # keeps its letter; a replay of it looks again (`_replayed`).
        return await _unlettered_if_cancelled_meanwhile(command, decision, deps)
    log.warning("%s: the attempt was taken over before its decision landed", command.task_id)
    return Drop("the attempt was taken over by another worker, whose decision stands")


async def _record(command: ScoreText, called: Called, deps: ScorerDeps) -> bool:
    """Record the decision, trying again while our claim holds.

    The model has been called: a decision lost to a slow or absent database would cost a
    second call once the claim's lease expired. Until then no other delivery claims the
    attempt, so the write is repeated (it is idempotent); past it, the error goes to the
    consumer, which sends the message again, as for any database failure. A write the
    database refuses for good (a failed validation, a document over 16 MiB) is not repeated:
    it went to the consumer only once the lease ended, which then sent the message again
    uncounted, to call the model again and be refused again, for ever; it goes to the
    consumer at once, as a crash. False when the attempt was taken over meanwhile
    (`Attempts.decide`).
    """
    held_until = called.claimed_at + deps.lease
    return await keep_trying_database(
        lambda: deps.attempts.decide(
            command,
            called.decision,
            now=deps.clock(),
            raw_output=called.raw_output,
            owner=deps.owner,
            claim=called.claim,
        ),
        what=f"recording the decision of {command.task_id}",
        give_up_after_s=(held_until - deps.clock()).total_seconds(),
    )


async def _call_model_announcing(
    command: ScoreText, started: TaskStarted, deps: ScorerDeps, earlier: Spent | None, turn: Turn
) -> tuple[Finish | Retry, str | None]:
    """Call the model; publish `started` once the call has run for `deps.started_after`.

    A call that ends sooner needs no `task.started`: its outcome follows at once, and the
    projection applies whatever is newest. An announcement that was due is confirmed before
    this returns, so it never reaches the broker after the outcome.
    """
    if deps.started_after <= timedelta(0):
        await _announce_best_effort(started, deps)
        return await _call_model(command, deps, earlier, turn)
    due: list[asyncio.Task[None]] = []
    timer = asyncio.get_running_loop().call_later(
        deps.started_after.total_seconds(),
        lambda: due.append(asyncio.create_task(_announce_best_effort(started, deps))),
    )
    try:
        return await _call_model(command, deps, earlier, turn)
    finally:
        timer.cancel()
        for announcement in due:
            await announcement


async def _announce_best_effort(started: TaskStarted, deps: ScorerDeps) -> None:
    """The outcome supersedes `task.started`, so a failed publish is logged and the attempt
    goes on (a broker that is down fails the outcome's publish next, which the consumer
    handles)."""
    try:
        await deps.announce(started)
    except Exception as error:  # noqa: BLE001 - the outcome supersedes the event
        log.warning("task.started of %s not published: %r", started.task_id, error)


async def _call_model(
    command: ScoreText, deps: ScorerDeps, earlier: Spent | None, turn: Turn
) -> tuple[Finish | Retry, str | None]:
    """The attempt's decision; its outcome's usage counts in what `earlier` attempts of the
    generation were billed, a retry carries it on. A 429 pauses this process's model calls
    (`deps.throttle`), and so does the provider found unavailable (or silent) by the calls of
    several texts in a row; any other answer tells the throttle the provider took the call."""
    request = ScoringRequest(
        task_id=command.task_id, text=command.text, rubric=command.rubric, model=command.model
    )
    started = time.perf_counter()
    try:
        verdict = await deps.model.score(request)
    except TransientError as error:
        _count_call(deps.metrics, "transient", error.code, started)
        outage = await _tell_the_throttle(
            deps.throttle, turn, error, command, deps.model_slots.closing
        )
        return _retry_or_give_up(command, error, deps, earlier, outage=outage), None
    except PermanentError as error:
        _count_call(deps.metrics, "permanent", error.code, started)
        deps.throttle.answered(turn, text_key=hash(command.text))
        # An unusable answer's text is the one most worth auditing.
        failed = _failed(command, error, deps.clock(), dead_letter=False, earlier=earlier)
        return failed, getattr(error, "raw_output", None)
    _count_call(deps.metrics, "completed", "", started)
    deps.throttle.answered(turn, text_key=hash(command.text))
    return _completed(command, verdict, deps.clock(), earlier), verdict.raw_output


async def _tell_the_throttle(
    throttle: ModelThrottle,
    turn: Turn,
    error: TransientError,
    command: ScoreText,
    closing: asyncio.Event | None = None,
) -> bool:
    """What a call that failed found; True when the call is an outage's rather than its
    task's. A provider that answered (a 429, a 4xx of no other class, a reply it could not
    use) is up: that breaks a run of calls finding it down. A start's first call finding it
    down waits for a check of the provider (`ModelThrottle.found_unavailable`; `closing`,
    the scorer stopping, cuts it short)."""
    if isinstance(error, ModelRateLimited):
        throttle.rate_limited(turn, error.retry_after_s)
        return False
    if error.provider_down:
        return await throttle.found_unavailable(
            turn,
            error.retry_after_s,
            text_key=hash(command.text),
            task_key=f"{command.task_id}:{command.generation}",
            tenant_key=command.tenant_id,
            model=command.model,
            closing=closing,
        )
    throttle.answered(turn, text_key=hash(command.text))
    return False


def _count_call(metrics: ScorerMetrics, outcome: str, code: str, started: float) -> None:
    metrics.model_calls.labels(outcome, code).inc()
    metrics.model_call_seconds.labels(outcome).observe(time.perf_counter() - started)


def _outcome_fields(command: ScoreText, now: datetime) -> dict[str, object]:
    return {
        **_event_fields(command, Phase.TERMINAL, now),
        "has_callback": command.callback_url is not None,
        "callback_url": command.callback_url,
    }


def _billed(command: ScoreText, earlier: Spent | None, error: ScoringError) -> Spent | None:
    """What the generation was billed up to and with the attempt that failed with `error`:
    `earlier` attempts' tokens and those of the answers that came back before it."""
    if error.usage is None:
        return earlier
    return (earlier or Spent(command.generation, Usage())).plus(error.usage, error.model)


def _completed(
    command: ScoreText, verdict: ModelVerdict, now: datetime, earlier: Spent | None
) -> Finish:
    fields = _outcome_fields(command, now)
    result = verdict.result
    if earlier is not None:
        result = result.model_copy(update={"usage": add_usage(earlier.usage, result.usage)})
    return Finish(
        TaskCompleted.model_validate(
            {**fields, "result": result, "requested_model": verdict.requested_model}
        )
    )


def _failed(
    command: ScoreText,
    error: ScoringError,
    now: datetime,
    *,
    dead_letter: bool,
    earlier: Spent | None = None,
) -> Finish:
    spent: dict[str, object] = {}
    if (total := _billed(command, earlier, error)) is not None:
        spent = {"usage": total.usage, "model": total.model}
    event = TaskFailed.model_validate(
        {
            **_outcome_fields(command, now),
            "error": error.to_task_error(),
            "dead_lettered": dead_letter,
            **spent,
        }
    )
    reason = f"{error.code}: {error}" if dead_letter else None
    return Finish(event, dead_letter_error=reason)


def _retry_or_give_up(
    command: ScoreText,
    error: TransientError,
    deps: ScorerDeps,
    earlier: Spent | None,
    *,
    outage: bool = False,
) -> Finish | Retry:
    """The next attempt, or the task's failure once its attempts are spent. An attempt the
    provider's rate limit ended, or an outage that pauses the calls (`outage`: the probes
    that find it still down), is not counted against `max_attempts` while the scorer's
    `RATE_LIMIT_RETRIES` last: they say nothing of the task, and a provider limited for a
    minute spent every task's attempts in it. Its retry waits for the pause too."""
    now = deps.clock()
    policy = deps.retry_policy
    free = (outage or isinstance(error, ModelRateLimited)) and (
        command.rate_limited_retries < policy.rate_limit_retries
    )
    if not free and command.attempt - command.rate_limited_retries >= command.max_attempts:
        return _failed(command, error, now, dead_letter=True, earlier=earlier)
    delay = policy.delay_s(command.attempt, error.retry_after_s, deps.rng)
    due = now + timedelta(seconds=max(delay, deps.throttle.pause_left_s()))
    update: dict[str, object] = {
        "attempt": command.attempt + 1,
        "not_before": due,
        "message_id": new_id(),
    }
    if free:
        update["rate_limited_retries"] = command.rate_limited_retries + 1
    next_command = command.model_copy(update=update)
    event = TaskRetrying.model_validate(
        {
            **_event_fields(command, Phase.RETRYING, now),
            "error": error.to_task_error(),
            "next_attempt_at": due,
        }
    )
    return Retry(event=event, next_command=next_command, spent=_billed(command, earlier, error))
