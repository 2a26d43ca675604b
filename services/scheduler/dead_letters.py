"""Operating the cron-jobs dead-letter queue (`scorebox.cron-jobs.dlq`): list, replay, drop,
purge.

A cron run given up for good (its job gave up, or its delivery reached the queue's limit) is
copied there by the job consumer with its reason, its firing recorded `failed`. The queue is
walked as the score queue's is (`shared.dead_letters`: held unacknowledged, then returned).

Replay runs the letter's job again as a new manual firing that names the dead run
(`replay_of`, `services.scheduler.dispatcher.fire_replay`); once the broker confirmed its
`RunCronJob`, the letter is acked. A run replayed already is not run again: its letter (a
copy, or one whose ack was lost) is acked and answered with the earlier replay, so a replay
cut short can simply be asked again. A replay naming by id a letter whose job is no longer
configured is refused before anything is sent (`ReplayRefused`): every letter is kept; a
replay of all skips such letters (kept, and reported). A letter whose job forbids overlapping
runs and has one in progress (another letter's replay, say) is kept and reported
(`skipped_in_progress`): replayed beside it, it would only do the same work again.

Drop acks the letters of one run (every copy) without running anything: the way out of the
DLQ for a letter replay refuses (its job no longer configured) or one that holds no run (by
its message id).

A listing says when it was taken (`CronWalk.listed_at`, read before the walk); a drop or a
purge given a cut-off (`shared.dead_letters.CutOff`, that time) removes only the letters known
to have been dead-lettered before it and keeps the others, those dead-lettered after the
listing first.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass, field
from datetime import datetime

from aio_pika.abc import AbstractIncomingMessage
from pydantic import ValidationError
from pymongo.errors import PyMongoError

from services.scheduler.errors import (
    DispatchFailed,
    ReplayRefused,
    RunInProgress,
    TriggeredTooOften,
)
from services.scheduler.firings import Firing, LeaseTaken
from services.scheduler.jobs import Clock
from services.scheduler.schedule import JobCatalog
from shared.bus import BROKER_ERRORS
from shared.contracts import RunCronJob
from shared.database_errors import transient_database_error
from shared.dead_letters import (
    REPLAY_BUDGET_S,
    CutOff,
    DeadLetterWalker,
    Dropped,
    dead_lettered_at,
    letter_id,
    oldest_first,
    reason,
    unmatched,
)
from shared.topology import CRON_JOBS, DEAD_LETTERED_FROM_HEADER

# Runs a dead run's job again: (the replaying firing, whether it was started now).
ReplayRun = Callable[[RunCronJob], Awaitable[tuple[Firing, bool]]]


@dataclass(frozen=True)
class CronDeadLetter:
    message_id: str | None
    run_id: str | None
    job: str | None
    job_configured: bool
    scheduled_for: datetime | None
    fired_at: datetime | None
    manual: bool | None
    attempt: int | None
    slice: int | None
    reason: str
    queue: str
    dead_lettered_at: datetime | None
    body_preview: str


def _read(message: AbstractIncomingMessage) -> RunCronJob | None:
    with contextlib.suppress(ValidationError):
        return RunCronJob.model_validate_json(message.body)
    return None


def _run_id(message: AbstractIncomingMessage) -> str | None:
    command = _read(message)
    return command.run_id if command else message.correlation_id


def describe(message: AbstractIncomingMessage, now: datetime, jobs: JobCatalog) -> CronDeadLetter:
    command = _read(message)
    headers = dict(message.headers)
    return CronDeadLetter(
        message_id=letter_id(message),
        run_id=command.run_id if command else message.correlation_id,
        job=command.job if command else None,
        job_configured=command is not None and jobs.runnable(command.job),
        scheduled_for=command.scheduled_for if command else None,
        fired_at=command.fired_at if command else None,
        manual=command.manual if command else None,
        attempt=command.attempt if command else None,
        slice=command.slice if command else None,
        reason=reason(headers),
        queue=str(headers.get(DEAD_LETTERED_FROM_HEADER, CRON_JOBS.name)),
        dead_lettered_at=dead_lettered_at(message, now),
        body_preview=message.body[:200].decode("utf-8", "replace"),
    )


@dataclass(frozen=True)
class CronWalk:
    """The letters of one walk, oldest dead-lettered first; `truncated` when it stopped (at
    `MAX_WALK` letters or its byte budget) with letters left behind it; `listed_at`, the clock
    read before the walk began (a cut-off for a drop or a purge)."""

    letters: list[CronDeadLetter]
    truncated: bool
    listed_at: datetime


@dataclass(frozen=True)
class ReplayedLetter:
    dead_run_id: str
    job: str
    run: Firing  # the replaying firing
    started_now: bool  # False: the run had been replayed already (no new run)


@dataclass(frozen=True)
class CronReplay:
    replayed: list[ReplayedLetter]
    skipped_unreadable: list[str]  # message ids of letters that hold no `RunCronJob`
    # run ids of jobs no longer configured or unable to run here (replay of all)
    skipped_unconfigured: list[str]
    not_found: list[str]  # run ids no letter matched, the walk having reached the queue's end
    # run ids of letters kept because their job has a run in progress that forbids overlap
    skipped_in_progress: list[str] = field(default_factory=list)
    # run ids no letter matched before the walk stopped short of the queue's end
    not_reached: list[str] = field(default_factory=list)
    truncated: bool = False  # the walk stopped with letters left behind it
    timed_out: bool = False  # the budget ran out with letters chosen and left
    # Why the replay stopped before the letters left (their runs asked for `not_reached`):
    # the broker or the database failed, or the job was triggered too often, once some
    # letters were replayed (those in `replayed`).
    interrupted: str | None = None


log = logging.getLogger("scorebox.scheduler.dead_letters")

# What ends a replay part-way once it replayed a letter (raised before that).
INTERRUPTIONS = (*BROKER_ERRORS, DispatchFailed, TriggeredTooOften, PyMongoError)


def interruption(error: BaseException) -> str:
    """What stopped a replay, as the 503, 429 or 500 it would have answered says it; logged."""
    if isinstance(error, PyMongoError) and not transient_database_error(error):
        log.error(
            "a cron dead-letter replay stopped: the database refused for good", exc_info=error
        )
        return (
            f"The database refused an operation for good ({type(error).__name__}; the "
            "scheduler's log has it): asking again meets the same refusal until it is mended."
        )
    log.warning("a cron dead-letter replay stopped part-way: %r", error)
    if isinstance(error, DispatchFailed | TriggeredTooOften):
        return f"{str(error).rstrip('.;')}; try again shortly."
    away = "The database" if isinstance(error, PyMongoError) else "The message broker"
    return f"{away} is unavailable; try again shortly."


@dataclass
class _Chosen:
    """The letters of a walk a replay asked for: readable ones, the message ids of the
    unreadable, and every run id matched."""

    letters: list[tuple[AbstractIncomingMessage, RunCronJob]] = field(default_factory=list)
    unreadable: list[str] = field(default_factory=list)
    found: set[str] = field(default_factory=set)


def _chosen(
    held: Collection[AbstractIncomingMessage], wanted: frozenset[str] | None, now: datetime
) -> _Chosen:
    chosen = _Chosen()
    for message in sorted(held, key=lambda m: oldest_first(dead_lettered_at(m, now))):
        command = _read(message)
        run_id = command.run_id if command else message.correlation_id
        if wanted is not None and run_id not in wanted:
            continue
        chosen.found.add(run_id or "")
        if command is None:
            chosen.unreadable.append(letter_id(message))
        else:
            chosen.letters.append((message, command))
    return chosen


@dataclass
class _ReplayRun:
    """What replaying the chosen letters did, and the runs of the letters it left."""

    replayed: list[ReplayedLetter] = field(default_factory=list)
    in_progress: list[str] = field(default_factory=list)
    left: set[str] = field(default_factory=set)
    interrupted: str | None = None

    def leave(self, letters: list[tuple[AbstractIncomingMessage, RunCronJob]]) -> None:
        done = {letter.dead_run_id for letter in self.replayed}
        self.left = {c.run_id for _, c in letters} - done - set(self.in_progress)


class CronDeadLetters:
    def __init__(
        self,
        walker: DeadLetterWalker,
        *,
        jobs: JobCatalog,
        replay_run: ReplayRun,
        clock: Clock,
        replay_budget_s: float = REPLAY_BUDGET_S,
    ) -> None:
        self._dlq = walker
        self._replay_budget_s = replay_budget_s
        self._jobs = jobs
        self._replay_run = replay_run
        self._clock = clock

    async def letters(self) -> CronWalk:
        now = self._clock()
        async with self._dlq.walk() as held:
            letters = [describe(message, now, self._jobs) for message in held]
        letters.sort(key=lambda letter: oldest_first(letter.dead_lettered_at))
        return CronWalk(letters, truncated=held.stopped_short, listed_at=now)

    async def replay(self, run_ids: Collection[str] | None) -> CronReplay:
        """Replay the letters of the runs `run_ids` (all when None), oldest first, for up to
        the replay's budget (`REPLAY_BUDGET_S`, its turn and the walk included): the letters
        left then stay and are reported (`timed_out`; their runs asked for `not_reached`).

        Raises `ReplayRefused` before anything is sent when one of the runs asked for by id
        names a job no longer configured, or one its settings leave unable to run; replaying
        all skips (and keeps) those letters, so one retired job does not hold back the
        others. The errors of `fire_replay` (`INTERRUPTIONS`) raise when no letter was
        replayed yet; after one was, they end the replay with what it did, the letters left
        kept and reported as the budget's are (`interrupted` says why): raised, a 503 hid the
        runs started, and the retry it asked for found their letters gone (`not_found`)."""
        stop_at = asyncio.get_running_loop().time() + self._replay_budget_s
        now = self._clock()
        # Looked up once per letter: in the list as asked for (up to 10,000 run ids), that
        # was up to 10,000 x 10,000 comparisons in one walk.
        wanted = None if run_ids is None else frozenset(run_ids)
        async with self._dlq.walk(deadline=stop_at) as held:
            chosen = _chosen(held, wanted, now)
            gone = {c.run_id: c.job for _, c in chosen.letters if not self._jobs.runnable(c.job)}
            if gone and wanted is not None:
                raise ReplayRefused(gone)
            runnable = [(message, c) for message, c in chosen.letters if c.run_id not in gone]
            run = await self._replay_letters(runnable, stop_at)
        not_found, not_reached = unmatched(
            run_ids or [], chosen.found, truncated=held.stopped_short, left=run.left
        )
        return CronReplay(
            run.replayed,
            chosen.unreadable,
            list(gone),
            not_found,
            run.in_progress,
            not_reached=not_reached,
            truncated=held.truncated,
            timed_out=held.timed_out or (bool(run.left) and run.interrupted is None),
            interrupted=run.interrupted,
        )

    async def _replay_letters(
        self, chosen: list[tuple[AbstractIncomingMessage, RunCronJob]], stop_at: float
    ) -> _ReplayRun:
        """Replay `chosen` in order until done, out of budget (`stop_at`, the event loop's
        clock), or interrupted; the runs left are those of the letters not reached."""
        loop = asyncio.get_running_loop()
        run = _ReplayRun()
        for index, (message, command) in enumerate(chosen):
            # Any letter tried counts (one whose run is in progress costs round trips
            # too): the budget held only once a letter was replayed.
            if index and loop.time() >= stop_at:
                run.leave(chosen[index:])
                break
            try:
                firing, started_now = await self._replay_run(command)
            except (RunInProgress, LeaseTaken):  # its lease changing hands: in progress
                run.in_progress.append(command.run_id)
                continue
            except INTERRUPTIONS as error:
                if not run.replayed:
                    raise
                run.interrupted = interruption(error)
                run.leave(chosen[index:])
                break
            # Run: replayed, whatever becomes of the ack (a letter whose ack fails stays,
            # and its replay finds the run replayed already: `fire_replay`).
            run.replayed.append(ReplayedLetter(command.run_id, command.job, firing, started_now))
            try:
                await self._dlq.remove(message)
            except BROKER_ERRORS as error:
                run.interrupted = interruption(error)
                run.leave(chosen[index + 1 :])
                break
        return run

    async def drop(self, run_id: str, *, cut_off: CutOff | None = None) -> Dropped:
        """Remove every letter of the run `run_id` (each copy of it), or the letter whose
        message id it is (one that holds no run has no run id); nothing is run. Given a
        `cut_off`, only those known to have been dead-lettered before it (the others are
        `kept`)."""
        return await self._dlq.drop(
            lambda message: run_id in (_run_id(message), letter_id(message)), cut_off=cut_off
        )

    async def purge(self) -> int:
        return await self._dlq.purge()

    async def purge_before(self, cut_off: CutOff) -> Dropped:
        """Remove the letters a walk reaches that are known to have been dead-lettered before
        `cut_off`; the others are `kept`."""
        return await self._dlq.purge_before(cut_off)
