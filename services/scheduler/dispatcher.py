"""The scheduler's clock loop: every tick, claim due firings and publish them as `RunCronJob`.

The dispatcher only dispatches; jobs run in the job consumer (any replica), with retries and
dead-lettering like every other queue. Per job it keeps the next fire time in memory and
asks the database only once that time has come, so idle ticks cost nothing. Each tick also
publishes again any firing left `claimed` for longer than `redispatch_after` (the claiming
replica died between its claim and its publish, or the broker refused the publish).

A tick plans every job by the time it began (`now`), but each claim, re-claim, skip and
mark as sent is stamped with the clock read when it is written. Stamped with the tick's
`now`, the claim of a job behind a slow one (its database and broker calls near their
timeouts) was already older than `redispatch_after` when it was written: another replica
took it for abandoned and published it while this one did, and the fire time ran twice.

A job that forbids overlapping runs (the default) is not started while a run of it is in
progress: its fire time is recorded as skipped ("overlap"), a manual run refused
(`RunInProgress`); see `services.scheduler.overlap`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from datetime import UTC, datetime, timedelta

from services.scheduler.config import MissedFirings
from services.scheduler.errors import (
    DispatchFailed,
    DispatchUnknown,
    JobNotRunnable,
    RunInProgress,
    TriggeredTooOften,
)
from services.scheduler.firings import Firing, FiringState, FiringStore
from services.scheduler.jobs import Clock
from services.scheduler.overlap import Claim, Overlap, claim_unless_overlapping
from services.scheduler.schedule import JobCatalog, ScheduledJob, plan_firings
from shared.bus import BROKER_ERRORS, error_words
from shared.contracts import RunCronJob, rfc3339, to_millis
from shared.database_errors import transient_database_error
from shared.log_rate import Tally

NEVER = datetime.max.replace(tzinfo=UTC)  # a job whose schedule has no later date

log = logging.getLogger("scorebox.scheduler.dispatcher")

Publish = Callable[[RunCronJob], Awaitable[None]]
REDISPATCH_BATCH = 100
# Two manual triggers of one job within the same millisecond collide on the unique index;
# the later one moves by a millisecond.
MANUAL_CLAIM_TRIES = 5
# A run that has shown no sign of life for this long no longer holds its job
# (`SCHEDULER_RUN_STALE_S`).
DEFAULT_STALE_AFTER = timedelta(hours=1)


def run_command_for(firing: Firing) -> RunCronJob:
    return RunCronJob(
        task_id=firing.run_id,
        job=firing.job,
        scheduled_for=firing.scheduled_for,
        fired_at=firing.fired_at,
        manual=firing.manual,
        step=firing.step,
    )


async def dispatch(firing: Firing, *, firings: FiringStore, publish: Publish, clock: Clock) -> None:
    """Publish a claimed firing, then record that it left (unless it has already started)."""
    await publish(run_command_for(firing))
    await firings.mark_dispatched(firing.run_id, now=clock())


async def fire_by_hand(
    name: str,
    *,
    jobs: JobCatalog,
    firings: FiringStore,
    publish: Publish,
    clock: Clock,
    owner: str,
    replay_of: str | None = None,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
) -> Firing:
    """A manual firing of `name` (enabled or not), published now; the schedule is unaffected.
    `replay_of`: the dead-lettered run it replays (`fire_replay`).

    Raises `UnknownJob`, `JobNotRunnable`, `TriggeredTooOften`, `RunInProgress` when the job forbids
    overlapping runs and one is in progress, or `DispatchFailed` when the broker refused it
    (the firing is then withdrawn: nothing half-done is left behind). A refused run that
    goes ahead all the same is returned: `dispatched` when a consumer has started it (the
    publish reached the queue after all), `claimed` when it could not be withdrawn (the
    dispatcher publishes it after `SCHEDULER_REDISPATCH_S`).
    """
    job = jobs.get(name)
    if job.cannot_run is not None:
        raise JobNotRunnable(name, job.cannot_run)
    firing = await _claim_manual(
        job,
        firings=firings,
        clock=clock,
        owner=owner,
        replay_of=replay_of,
        stale_after=stale_after,
    )
    try:
        await publish(run_command_for(firing))
    except Exception as error:
        going_ahead = await _withdraw(firing, firings=firings, error=error)
        if going_ahead is None:
            raise DispatchFailed(
                f"the broker did not accept the run of {name!r}: {error_words(error)}"
            ) from error
        log.warning(
            "job %s: run %s goes ahead (%s) although its publish failed: %r",
            name,
            firing.run_id,
            going_ahead.value,
            error,
        )
        return dataclasses.replace(firing, state=going_ahead)
    try:
        await firings.mark_dispatched(firing.run_id, now=clock())
    except Exception as error:  # noqa: BLE001 - the run is on its way: its start records it
        log.warning("job %s: run %s sent, not marked as sent: %r", name, firing.run_id, error)
    log.info("job %s: fired by hand (run %s)", job.name, firing.run_id)
    return dataclasses.replace(firing, state=FiringState.DISPATCHED)


async def fire_replay(
    dead: RunCronJob,
    *,
    jobs: JobCatalog,
    firings: FiringStore,
    publish: Publish,
    clock: Clock,
    owner: str,
    stale_after: timedelta = DEFAULT_STALE_AFTER,
) -> tuple[Firing, bool]:
    """Run the job of a dead-lettered run again, as a new manual firing linked to it
    (`replay_of`); (that firing, True) once its `RunCronJob` is confirmed.

    A run replayed already is not run again: (its replay, False). Its letter came back (the
    ack after the replay was lost) or the DLQ held two copies of it, which two replicas may
    replay at the same instant: the firings' unique `replay_of` lets one claim through, and
    the other, refused at every key it tries, finds that one's. Raises as `fire_by_hand`.
    """
    earlier = await firings.replayed_as(dead.run_id)
    if earlier is not None:
        return earlier, False
    try:
        firing = await fire_by_hand(
            dead.job,
            jobs=jobs,
            firings=firings,
            publish=publish,
            clock=clock,
            owner=owner,
            replay_of=dead.run_id,
            stale_after=stale_after,
        )
    except TriggeredTooOften:
        if (earlier := await firings.replayed_as(dead.run_id)) is None:
            raise
        return earlier, False
    log.info("job %s: run %s replays dead-lettered run %s", dead.job, firing.run_id, dead.run_id)
    return firing, True


async def _claim_manual(
    job: ScheduledJob,
    *,
    firings: FiringStore,
    clock: Clock,
    owner: str,
    replay_of: str | None,
    stale_after: timedelta,
) -> Firing:
    for at in _manual_fire_times(clock()):
        claim = Claim(job, at, owner=owner, manual=True, replay_of=replay_of)
        firing = await claim_unless_overlapping(
            claim, firings=firings, clock=clock, stale_after=stale_after
        )
        if isinstance(firing, Overlap):
            holder = firing.holder
            raise RunInProgress(job.name, holder.run_id, holder.state.value, holder.heartbeat_at)
        if firing is not None:
            return firing
    raise TriggeredTooOften(job.name)


class FireTimeUndecided(Exception):
    """A fire time whose job's lease a run by hand holds while it is being published: asked
    again at the next tick, when that run has gone ahead (an overlap, recorded skipped) or
    been withdrawn (the fire time runs)."""


async def _withdraw(
    firing: Firing, *, firings: FiringStore, error: Exception
) -> FiringState | None:
    """Withdraw a manual firing whose publish failed: None once withdrawn, else the state in
    which it goes ahead: `dispatched` when a consumer started it (an unconfirmed publish
    that reached the queue), `claimed` when the withdrawal failed and the firing is still
    there (answered as refused, that one invited a retry while the dispatcher was to publish
    it: a second run). A withdrawal that failed is read back: its write may have been
    applied with its answer lost, and answered `claimed`, that run was never published."""
    try:
        if await firings.forget_unpublished(firing.run_id):
            return None
    except Exception as forget_error:  # noqa: BLE001 - any failure: read what stands
        return await _standing_after_failed_withdrawal(firing, firings, error, forget_error)
    return FiringState.DISPATCHED


async def _standing_after_failed_withdrawal(
    firing: Firing, firings: FiringStore, error: Exception, forget_error: Exception
) -> FiringState | None:
    try:
        standing = await firings.find(firing.run_id)
    except Exception as read_error:  # noqa: BLE001 - unknown: refused, it may run later
        raise DispatchUnknown(
            f"the broker did not accept the run of {firing.job!r} ({error_words(error)}), and "
            f"it could not be withdrawn ({error_words(forget_error)}) nor read "
            f"({error_words(read_error)}): run "
            f"{firing.run_id} may still run later",
            run_id=firing.run_id,
        ) from error
    if standing is None:
        return None
    log.warning(
        "job %s: run %s refused by the broker (%r) could not be withdrawn (%r); it goes ahead (%s)",
        firing.job,
        firing.run_id,
        error,
        forget_error,
        standing.state.value,
    )
    return FiringState.CLAIMED if standing.state is FiringState.CLAIMED else FiringState.DISPATCHED


def _manual_fire_times(now: datetime) -> list[datetime]:
    """Keys for a manual firing, `now` first, never a whole second: fire times of the schedule
    are whole seconds, and a manual firing that took one's key made the dispatcher read that
    fire time as claimed by another replica (it never ran)."""
    candidates = (to_millis(now + timedelta(milliseconds=n)) for n in range(MANUAL_CLAIM_TRIES + 1))
    return [at for at in candidates if at.microsecond][:MANUAL_CLAIM_TRIES]


class Dispatcher:
    def __init__(
        self,
        jobs: JobCatalog,
        *,
        firings: FiringStore,
        publish: Publish,
        clock: Clock,
        grace: timedelta,
        redispatch_after: timedelta,
        owner: str,
        stale_after: timedelta = DEFAULT_STALE_AFTER,
    ) -> None:
        self._jobs = jobs
        self._firings = firings
        self._publish = publish
        self._clock = clock
        self._grace = grace
        self._redispatch_after = redispatch_after
        self._owner = owner
        self._stale_after = stale_after
        self._next_due: dict[str, datetime] = {}
        self._last_tick_at: datetime | None = None
        self.ticks = 0
        self.away = DependencyAway()

    async def tick(self) -> list[Firing]:
        """One pass over the enabled jobs; returns the firings this replica dispatched."""
        now = self._clock()
        self._notice_clock_going_back(now)
        dispatched = []
        for job in self._jobs.enabled:
            next_due = self._next_due.get(job.name)
            if next_due is not None and now < next_due:
                continue
            try:
                firing = await self._fire_if_due(job, now)
            except FireTimeUndecided as undecided:
                log.debug("job %s: asked again next tick: %s", job.name, undecided)
                continue
            except Exception as error:  # one job's trouble must not stop the others
                if not self.away.failed(f"job {job.name}: firing", error):
                    log.exception("job %s: could not fire; trying again next tick", job.name)
                continue
            self._next_due[job.name] = job.next_fire_time(now) or NEVER
            if firing is not None:
                dispatched.append(firing)
        dispatched.extend(await self._redispatch_stale(self._clock()))
        self.ticks += 1
        return dispatched

    def _notice_clock_going_back(self, now: datetime) -> None:
        """Forget the next fire times worked out before the clock went back (an NTP step
        after running ahead): they lie ahead of real time and would keep jobs waiting."""
        if self._last_tick_at is not None and now < self._last_tick_at:
            log.warning(
                "the clock went back from %s to %s; planning every job again",
                self._last_tick_at.isoformat(),
                now.isoformat(),
            )
            self._next_due.clear()
        self._last_tick_at = now

    async def _fire_if_due(self, job: ScheduledJob, now: datetime) -> Firing | None:
        last = await self._firings.last_scheduled(job.name, not_after=now)
        plan = plan_firings(job, last=last, now=now, grace=self._grace)
        if plan.skip is not None:
            if await self._firings.record_skipped(
                job.name, plan.skip, now=self._clock(), owner=self._owner, missed=plan.missed
            ):
                log.warning(
                    "job %s: skipped %d missed firing(s) up to %s (policy skip)",
                    job.name,
                    plan.missed,
                    plan.skip.isoformat(),
                )
            return None
        if plan.run is None:
            return None
        claim = Claim(job, plan.run, owner=self._owner, missed=plan.missed)
        firing = await claim_unless_overlapping(
            claim, firings=self._firings, clock=self._clock, stale_after=self._stale_after
        )
        if isinstance(firing, Overlap):
            if firing.undecided:
                raise FireTimeUndecided(firing.reason)
            await self._skip_overlapping(claim, firing)
            return None
        if firing is None:
            return None  # another replica claimed it
        if plan.missed:
            log.info("job %s: %d missed firing(s) coalesced into this one", job.name, plan.missed)
        await dispatch(firing, firings=self._firings, publish=self._publish, clock=self._clock)
        log.info("job %s: fired for %s (run %s)", job.name, firing.scheduled_for, firing.run_id)
        return firing

    async def _skip_overlapping(self, claim: Claim, overlap: Overlap) -> None:
        """Record a fire time that came while a run of its job is in progress as skipped,
        which moves the schedule past it (another replica may have recorded it first)."""
        if await self._firings.record_skipped(
            claim.job.name,
            claim.scheduled_for,
            now=self._clock(),
            owner=self._owner,
            missed=claim.missed,
            reason=overlap.reason,
        ):
            log.warning(
                "job %s: firing for %s skipped: %s",
                claim.job.name,
                claim.scheduled_for.isoformat(),
                overlap.reason,
            )

    async def _redispatch_stale(self, now: datetime) -> list[Firing]:
        claimed_before = to_millis(now - self._redispatch_after)
        stale = await self._firings.stale_claims(
            claimed_before=claimed_before, limit=REDISPATCH_BATCH
        )
        taken = []
        for firing in stale:
            # Stamped now: the publishes of the firings before it may have taken a while.
            reclaimed_at = self._clock()
            if not await self._firings.reclaim(
                firing, claimed_before=claimed_before, now=reclaimed_at
            ):
                continue
            if reason := await self._superseded(firing, reclaimed_at):
                if await self._firings.supersede(firing.run_id, now=self._clock(), reason=reason):
                    log.warning("job %s: run %s skipped: %s", firing.job, firing.run_id, reason)
                continue
            log.warning(
                "job %s: run %s was never published; publishing it again",
                firing.job,
                firing.run_id,
            )
            await dispatch(firing, firings=self._firings, publish=self._publish, clock=self._clock)
            taken.append(firing)
        return taken

    async def _superseded(self, firing: Firing, now: datetime) -> str | None:
        """Why a firing never published is not to run any more, by its job's policy for
        missed firings; None when it is to be published again.

        A broker away for hours leaves one such firing per fire time: published again, each
        ran, where the policy runs the latest only (`coalesce`), or none that is late
        (`skip`). A manual firing, or one of a job no longer configured, is published."""
        if firing.manual or firing.job not in self._jobs:
            return None
        latest = await self._firings.last_scheduled(firing.job, not_after=now)
        if latest is not None and latest > firing.scheduled_for:
            return f"superseded by the firing for {rfc3339(latest)} (never published)"
        if self._jobs.get(firing.job).missed is MissedFirings.SKIP and self._late(firing, now):
            return "late by more than the grace period, never published (policy skip)"
        return None

    def _late(self, firing: Firing, now: datetime) -> bool:
        """Whether a firing never published is late for a `skip` job: kept from its publish
        for longer than the grace since its claim (the broker away). The plan refused it if
        it was late when planned, so its lateness then is not asked again: judged from its
        fire time, one claimed within the grace after a restart (40 s late) whose publish
        failed once was dropped at its re-publish (`SCHEDULER_REDISPATCH_S`, 30 s, later),
        and judged from its claim's stamp, one planned in time but claimed after the
        publishes of others took a while."""
        return now - firing.fired_at > self._grace


# How often at most ticks failing for a dependency away, with one kind of error, are logged.
AWAY_LOG_EVERY_S = 60.0


class DependencyAway:
    """The log of ticks failing for the database or the broker away: one WARNING a minute
    at most for each kind of error (a kind new to the outage at once). An ERROR with a
    traceback of 50-110 lines for every due job at every tick of a database stop buried the
    rest of the log (a walkthrough; its review found the per-job path, and one count hiding
    a new kind of error for a minute). No line says the ticks go through again: a tick
    that needs neither dependency goes through while both are away (a review)."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._tallies: dict[str, Tally] = {}
        self.failures = 0

    def failed(self, what: str, error: BaseException) -> bool:
        """Log `what` failing for `error` when a dependency away explains it; False (not
        logged) for any other error: a bug, the caller's to log with its traceback."""
        if not (transient_database_error(error) or isinstance(error, BROKER_ERRORS)):
            return False
        self.failures += 1
        kind = type(error).__name__
        tally = self._tallies.setdefault(kind, Tally(AWAY_LOG_EVERY_S, self._clock))
        if (count := tally.count()) is not None:
            log.warning(
                "%s failed, a dependency away (%d %s since the last such line): %s",
                what,
                count,
                kind,
                error_words(error),
            )
        return True


async def keep_dispatching(dispatcher: Dispatcher, *, interval_s: float) -> None:
    """Tick forever; a failed tick is logged (`DependencyAway`, or its traceback for a bug)
    and retried."""
    while True:
        try:
            await dispatcher.tick()
        except Exception as error:
            if not dispatcher.away.failed("scheduler tick", error):
                log.exception("scheduler tick failed; retrying in %.1fs", interval_s)
        await asyncio.sleep(interval_s)
