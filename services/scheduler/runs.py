"""Running one delivery of a `RunCronJob`: decide, never touch the broker.

    not yet due                     -> Defer    (down the wait ladder again; GiveUp when
                                                 its run's letter is owed, as below)
    run given up, its letter owed   -> GiveUp   (its recorded reason: the give-up's write
                                                 lost its answer, or its letter was refused;
                                                 any delivery of the run, any step)
    job unknown to this replica     -> Retry    (same attempt, for a replica that knows it,
                                                 marked `retrying` unless another delivery
                                                 holds the run; GiveUp once
                                                 UNKNOWN_JOB_MAX_WAIT has passed since the
                                                 firing; Drop as below)
    run unknown or already final    -> Drop     (a duplicate delivery, or a firing forgotten)
    run past the message's step     -> Drop     (a copy of a step carried out already)
    run held by another delivery    -> Defer    (a copy: sent again, `HELD_RECHECK` at most
                                                 later; `services.scheduler.firings`)
    job returned, more to do        -> Continue (same run, next slice, attempt 1)
    job returned                    -> Finished
    PermanentJobError               -> GiveUp
    DownstreamFull                  -> Retry    (same attempt, after the longest back-off;
                                                 GiveUp once the run has made no progress
                                                 for DOWNSTREAM_FULL_MAX_WAIT)
    any other error, attempts left  -> Retry    (back-off through the wait ladder)
    any other error, none left      -> GiveUp
    at the queue's delivery limit   -> GiveUp   (`give_up_at_delivery_limit`: not run again;
                                                 Drop when the run has ended already or
                                                 passed its step; Defer while it is held)

A delivery is at its queue's delivery limit (`x-delivery-count`, read by the consumer) when
it was returned unsettled that many times: the scheduler crashed or lost its connection
running it each time. Run again, it would most likely do the same, and RabbitMQ would then
dead-letter it without a word while its firing stayed `running` for ever. It is given up
instead: the firing recorded `failed` with the reason; a run that has ended already keeps
its end (the first end stands) and the delivery is dropped.

A give-up records the run `failed` and its dead letter owed in one write (`letter_owed`,
cleared by the consumer once the broker confirmed the letter). Should that write's answer be
lost (the delivery is then sent again as in a database outage) or the letter be refused (the
delivery returned as failed), the run has ended with no letter: whichever delivery of the
run comes next, on any replica, finds its letter owed and is given up with the recorded
reason instead of dropped. Two deliveries finding it owed at once both write it (a DLQ may
hold two copies of one dead letter).

A run waiting for room counts its wait from its last progress, as its messages carry it: a
continuation (`Continue`) is issued only after its slice moved the run on, and is stamped
with that moment (`occurred_at`), which the slice's retries keep; the first slice counts from
the firing. Counted from the firing, a large re-score that kept moving page by page behind a
slow scorer was given up 6 hours after it fired. (The fan-out ends its delivery as a
continuation when it meets no room after moving its checkpoint.)

Jobs are idempotent (rollups recompute and `$set`, the fan-out resumes from its checkpoint,
clean-ups delete what is expired), so the rare duplicate run is harmless.

A handler runs under a deadline of its own for its database work (`db_timeout_s`,
`SCHEDULER_JOB_DB_TIMEOUT_S`, applied with `pymongo.timeout`, which overrides the client's
`timeoutMS` inside the block): the client's `MONGO_TIMEOUT_S` is meant for request handling,
and a rollup's `update_many` over a day of usage records outlasts it, so every retry failed
alike. Recording the run's start and outcome keeps the client's bound.

That deadline covers the whole handler, broker waits included, so a job that works in steps
(the fan-out's pages) is told when to stop taking them (`JobRun.work_until`, `STEP_SHARE` of
the deadline after the handler starts): the step in hand then has the rest of the deadline.
Walking a fixed number of pages whatever the time, a delivery behind a slow broker began
pages it could not finish, failed on the deadline and was counted a failed attempt although
its checkpoint had moved; a run that moved in every delivery was given up.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any

import pymongo
from pymongo.errors import PyMongoError

from services.scheduler.errors import DownstreamFull, PermanentJobError
from services.scheduler.firings import Firing, FiringState, FiringStore, Held, Hold
from services.scheduler.in_hand import CronRunsInHand, CutShort
from services.scheduler.jobs import Clock, JobHandler, JobRun
from shared.backoff import capped_exponential_s
from shared.bus import error_words
from shared.contracts import RunCronJob, new_id
from shared.database_errors import transient_database_error

log = logging.getLogger("scorebox.scheduler.runs")
# A run due within this much is run now: the wait ladder's finest step is 1 s, and a message
# sent back for less would only bounce between the queue and this consumer.
DUE_TOLERANCE = timedelta(milliseconds=500)
# How long a run waits for room in a full queue it feeds (the re-score queue, say, behind a
# slow scorer) without progress before it is given up. Counting those waits as failed
# attempts gave a big fan-out up within a minute of the queue filling.
DOWNSTREAM_FULL_MAX_WAIT = timedelta(hours=6)
# How long a run of a job this replica has no handler for waits for a replica that has one.
# A rolling deploy that adds a job has replicas of the earlier build take runs of it off the
# shared queue; given up at once, such a run was failed for good (its fire time already the
# schedule's position) though the next delivery could have reached a replica knowing it.
UNKNOWN_JOB_MAX_WAIT = timedelta(minutes=15)
# The share of a delivery's database deadline a job that works in steps may spend taking new
# ones; the step in hand when it runs out (a page's broker waits, reads and writes) has the rest.
STEP_SHARE = 0.5
# The longest a copy of a run's message waits before it looks again at the run another
# delivery holds: the step may end (the copy is dropped) or its holder die (the copy takes
# over once the hold lapses).
HELD_RECHECK = timedelta(seconds=5)


@dataclass(frozen=True)
class RetryPolicy:
    max_attempts: int
    base: timedelta
    cap: timedelta

    def delay(self, attempt: int) -> timedelta:
        """Back-off after the failed `attempt` (1-based): base, 2 x base, 4 x base... capped."""
        backoff = capped_exponential_s(
            attempt, base_s=self.base.total_seconds(), cap_s=self.cap.total_seconds()
        )
        return timedelta(seconds=backoff)


@dataclass(frozen=True)
class Finished:
    summary: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Continue:
    command: RunCronJob


@dataclass(frozen=True)
class Retry:
    command: RunCronJob
    error: str
    # Whether the delivery ran the job holding the run, and hands its next step on; not a
    # run of a job this replica does not know, sent back untried.
    handing_on: bool = True


@dataclass(frozen=True)
class Defer:
    command: RunCronJob


@dataclass(frozen=True)
class GiveUp:
    reason: str


@dataclass(frozen=True)
class Drop:
    reason: str


RunDecision = Finished | Continue | Retry | Defer | GiveUp | Drop


def _describe(error: BaseException) -> str:
    return error_words(error)


async def run_cron_job(
    command: RunCronJob,
    *,
    handlers: Mapping[str, JobHandler],
    firings: FiringStore,
    retry: RetryPolicy,
    clock: Clock,
    db_timeout_s: float | None = None,
    hold: Hold | None = None,
    in_hand: CronRunsInHand | None = None,
) -> RunDecision:
    """`db_timeout_s`: the deadline of the handler's database work (None: each operation
    keeps the client's `timeoutMS`). `hold`: the delivery's bid to hold the run (None: run
    unfenced). `in_hand`: the stop's register, which may cut the handler short (`CutShort`,
    raised before any decision is recorded)."""
    if command.not_before is not None and command.not_before - clock() > DUE_TOLERANCE:
        return await _before_its_time(command, firings)
    handler = handlers.get(command.job)
    if handler is None:
        return await _wait_for_a_replica_knowing(command, firings=firings, retry=retry, clock=clock)
    began = await firings.begin(command.run_id, attempt=command.attempt, now=clock(), hold=hold)
    if began is None:
        return _ended(await firings.find(command.run_id), command)
    if isinstance(began, Held):
        return Defer(_waiting_for(command, began, now=clock()))
    following = command.model_copy(update={"step": began.step + 1})
    return await _run_handler(
        handler,
        following,
        firings=firings,
        retry=retry,
        clock=clock,
        db_timeout_s=db_timeout_s,
        in_hand=in_hand or CronRunsInHand(),
        key=hold.handling if hold is not None else None,
    )


async def _before_its_time(command: RunCronJob, firings: FiringStore) -> Defer | GiveUp:
    """A delivery ahead of its `not_before` goes down the wait ladder again, unless its run
    was given up with its letter owed: nothing is left to wait for (a copy sent again when
    the give-up's answer was lost is such a delivery). The look is a shortcut, the delivery
    looking again once due: a database error sends it down the ladder as before, never
    earlier than its time as a delivery sent again in an outage would be."""
    try:
        firing = await firings.find(command.run_id)
    except PyMongoError as error:
        log.warning("cron run %s not looked at before its time: %r", command.run_id, error)
        return Defer(command)
    return _letter_owed(firing) or Defer(command)


def _ended(firing: Firing | None, command: RunCronJob) -> GiveUp | Drop:
    """The decision for a delivery of a run unknown, ended or past its step: given up with
    the recorded reason when the run was given up and its letter is still owed (the
    give-up's answer lost, or its letter refused), else dropped."""
    return _letter_owed(firing) or Drop(
        f"run {command.run_id} is unknown, finished or past this step"
    )


def _letter_owed(firing: Firing | None) -> GiveUp | None:
    """The give-up whose dead letter the run still owes, with its recorded reason; None
    when it owes none (it was not given up, its letter was written, or it is a firing of an
    earlier build, which records no letter owed)."""
    if firing is None or not firing.owes_letter:
        return None
    return GiveUp(firing.error or f"cron run {firing.run_id} of job {firing.job!r} failed")


def _waiting_for(command: RunCronJob, held: Held, *, now: datetime) -> RunCronJob:
    """A copy of `command` to look at the run again once its hold may have ended (the next
    step, as soon as the wait ladder allows: its holder is naming it)."""
    soonest = now + timedelta(seconds=1)
    again = soonest if held.next_step else min(max(held.until, soonest), now + HELD_RECHECK)
    return command.model_copy(update={"message_id": new_id(), "not_before": again})


async def _run_handler(
    handler: JobHandler,
    command: RunCronJob,
    *,
    firings: FiringStore,
    retry: RetryPolicy,
    clock: Clock,
    db_timeout_s: float | None,
    in_hand: CronRunsInHand,
    key: str | None,
) -> RunDecision:
    started = clock()
    run = JobRun(
        run_id=command.run_id,
        job=command.job,
        scheduled_for=command.scheduled_for,
        fired_at=command.fired_at,
        manual=command.manual,
        attempt=command.attempt,
        slice=command.slice,
        work_until=_work_until(started, db_timeout_s),
    )
    try:
        with pymongo.timeout(db_timeout_s):
            outcome = await in_hand.run(handler(run), key=key)
    except CutShort:
        raise
    except PermanentJobError as error:
        return await _give_up(command, _describe(error), firings=firings, clock=clock)
    except DownstreamFull as error:
        log.warning("cron job %s (run %s) waits for room: %s", command.job, command.run_id, error)
        return await _wait_for_room(
            command, _describe(error), firings=firings, retry=retry, clock=clock
        )
    except Exception as error:
        outlasted = db_timeout_s is not None and clock() - started >= timedelta(
            seconds=db_timeout_s
        )
        if transient_database_error(error) and not outlasted:
            # An outage of the database is no bug of the job: a line, not a traceback (a
            # walkthrough found one for a stand-in stalled under load). A job that outlasts
            # its deadline keeps its traceback, which says which step ran out (the re-read).
            log.warning(
                "cron job %s (run %s) failed, its database unavailable: %r",
                command.job,
                command.run_id,
                error,
            )
        else:
            log.exception("cron job %s (run %s) failed", command.job, command.run_id)
        return await _retry_or_give_up(
            command, _describe(error), firings=firings, retry=retry, clock=clock
        )
    if outcome.more:
        following = command.model_copy(
            update={
                "message_id": new_id(),
                "slice": command.slice + 1,
                "attempt": 1,
                "not_before": None,
                # The run made progress: a wait for room in the next slice counts from here.
                "occurred_at": clock(),
            }
        )
        return Continue(following)
    await firings.finish(
        command.run_id, state=FiringState.SUCCEEDED, now=clock(), result=outcome.summary
    )
    return Finished(outcome.summary)


def _work_until(now: datetime, db_timeout_s: float | None) -> datetime | None:
    """When a delivery starting `now` stops taking new steps (None: no deadline, no limit).
    On the service's clock, as every other time of a run: a clock step only ends a delivery
    early (a continuation) or lets it walk to its page limit, as it did before."""
    if db_timeout_s is None:
        return None
    return now + timedelta(seconds=db_timeout_s * STEP_SHARE)


async def give_up_at_delivery_limit(
    command: RunCronJob, *, deliveries: int, limit: int, firings: FiringStore, clock: Clock
) -> GiveUp | Drop | Defer:
    """Give up a run whose delivery came back unsettled `deliveries` times (at least the
    queue's `limit`), without running it again; drop it when the run has ended already."""
    reason = (
        f"cron run {command.run_id} of job {command.job!r} was delivered {deliveries} times "
        "without being settled (the scheduler crashed or lost its connection running it); "
        f"delivery limit {limit} reached, so it is not run again"
    )
    standing = await firings.find(command.run_id)
    if standing is not None and (standing.state.is_final or standing.passed(command.step)):
        # Its letter owed: ours, the answer lost (waited out and tried again), or refused.
        return _ended(standing, command)
    if standing is not None and (held := standing.held_until(clock())) is not None:
        # Its holder carries it on, or died and its lease runs out: given up once it has.
        return Defer(_waiting_for(command, Held(until=held), now=clock()))
    if await _record_given_up(command, reason, firings=firings, clock=clock):
        return GiveUp(reason)
    # Ours, its answer lost to a retried write (its letter owed); or the run ended meanwhile.
    return _ended(await firings.find(command.run_id), command)


async def _give_up(
    command: RunCronJob, reason: str, *, firings: FiringStore, clock: Clock
) -> GiveUp | Drop:
    """Give the run up; when it had ended already (another delivery of it finished it: a
    replica's clock ahead, a loop stalled past the hold), its own end stands: a run that
    succeeded was dead-lettered, alerted on and, replayed, run again (found in review)."""
    if await _record_given_up(command, reason, firings=firings, clock=clock):
        return GiveUp(reason)
    return _ended(await firings.find(command.run_id), command)


async def _record_given_up(
    command: RunCronJob, reason: str, *, firings: FiringStore, clock: Clock
) -> bool:
    """Record the run failed with its dead letter owed, in one write (the consumer clears
    it once the broker confirmed the letter); False when the run had ended already."""
    return await firings.finish(
        command.run_id, state=FiringState.FAILED, now=clock(), error=reason, letter_owed=True
    )


async def _retry_or_give_up(
    command: RunCronJob, error: str, *, firings: FiringStore, retry: RetryPolicy, clock: Clock
) -> Retry | GiveUp | Drop:
    if command.attempt >= retry.max_attempts:
        reason = f"cron job {command.job!r} failed {command.attempt} times; last error: {error}"
        return await _give_up(command, reason, firings=firings, clock=clock)
    now = clock()
    not_before = now + retry.delay(command.attempt)
    await firings.retrying(command.run_id, error=error, next_attempt_at=not_before, now=now)
    following = command.model_copy(
        update={"message_id": new_id(), "attempt": command.attempt + 1, "not_before": not_before}
    )
    return Retry(following, error)


async def _wait_for_room(
    command: RunCronJob, error: str, *, firings: FiringStore, retry: RetryPolicy, clock: Clock
) -> Retry | GiveUp | Drop:
    now = clock()
    if now - waiting_since(command) >= DOWNSTREAM_FULL_MAX_WAIT:
        reason = (
            f"cron job {command.job!r} found no room for {DOWNSTREAM_FULL_MAX_WAIT} since it "
            f"last made progress; last error: {error}"
        )
        return await _give_up(command, reason, firings=firings, clock=clock)
    not_before = now + retry.cap
    await firings.retrying(command.run_id, error=error, next_attempt_at=not_before, now=now)
    following = command.model_copy(update={"message_id": new_id(), "not_before": not_before})
    return Retry(following, error)


async def _wait_for_a_replica_knowing(
    command: RunCronJob, *, firings: FiringStore, retry: RetryPolicy, clock: Clock
) -> Retry | GiveUp | Drop:
    """Send a run of a job this replica does not know back to the queue, its attempt not
    counted (it was not tried), until `UNKNOWN_JOB_MAX_WAIT` has passed since the run last
    made progress (`waiting_since`: its firing, or its slice's issue). A copy of a run
    unknown, ended or past its step is dropped (or dead-lettered, its letter owed); one of a
    run another delivery holds is sent back without marking the run `retrying`."""
    error = f"no handler for cron job {command.job!r} in this scheduler"
    now = clock()
    standing = await firings.find(command.run_id)
    if standing is None or standing.state.is_final or standing.passed(command.step):
        return _ended(standing, command)
    if standing.held_until(now) is not None:  # a replica knowing the job runs it
        return _sent_back(command, error, now=now, after=retry.base)
    if now - waiting_since(command) >= UNKNOWN_JOB_MAX_WAIT:
        reason = (
            f"{error}, nor in any that took the run within {UNKNOWN_JOB_MAX_WAIT} "
            "(is the job configured on every replica?)"
        )
        return await _give_up(command, reason, firings=firings, clock=clock)
    log.warning("cron run %s: %s; sent back for another replica", command.run_id, error)
    await firings.retrying(command.run_id, error=error, next_attempt_at=now + retry.base, now=now)
    return _sent_back(command, error, now=now, after=retry.base)


def _sent_back(command: RunCronJob, error: str, *, now: datetime, after: timedelta) -> Retry:
    """The run sent back untried, `after` from `now`, for a replica knowing its job."""
    following = command.model_copy(update={"message_id": new_id(), "not_before": now + after})
    return Retry(following, error, handing_on=False)


def waiting_since(command: RunCronJob) -> datetime:
    """When the run last made progress, as its messages tell: the first slice's firing, or
    when the slice was issued (a continuation is issued only after progress; its retries and
    deferrals keep its `occurred_at`)."""
    if command.slice == 0:
        return command.fired_at
    return max(command.fired_at, command.occurred_at)
