"""The scheduler's broker adapters: decode -> handler -> carry out the decision -> ack.

`scorebox.cron-jobs` (`RunCronJob`):
- unreadable body: copied to the DLQ with the validation error, then ack.
- Finished / Drop: ack.  Continue: next slice published, then ack.
- Retry / Defer: published down the wait ladder, then ack.
- GiveUp: copied to the DLQ with the reason (`x-scorebox-error`), the run's letter recorded
  written (`Firings.letter_written`, clearing the `letter_owed` its give-up set), then ack.
  A copy the broker refuses returns the delivery as failed (below), its letter still owed:
  whichever delivery of the run comes next, on any replica, is dead-lettered with the
  recorded reason rather than dropped (`services.scheduler.runs`), as is the copy sent
  again when the give-up's write lost its answer. A letter written whose record fails
  leaves it owed: a later delivery of the run writes a second copy.
- MongoDB unavailable around the job (recording its start or outcome; a transient error):
  the same command is re-sent after the retry base delay without counting an attempt, then
  ack. A permanent database error there (a result the database refuses) returns the
  delivery to its queue as failed, so its delivery limit bounds it: re-sent uncounted, it
  came back every few seconds for ever.
- a copy of the delivery's own run sent again (Defer, MongoDB unavailable, a stop) carries
  the deliveries its consumers lost so far (`x-scorebox-earlier-deliveries`), for the copy's
  own count starts at zero; a next slice or retry is a new message and carries none.
- a delivery runs only once it takes the run's hold (`services.scheduler.firings`); the
  hold is renewed until the run is handed on (`HOLD_LEASE`, `HOLD_RENEWAL_S`), a next slice
  or retry published and then named on the run (`hand_on`), and the hold let go before a
  delivery is handed back (a stop, MongoDB unavailable). A copy finding the run held waits
  down the ladder (Defer). A delivery whose hold may be another's (taken over, or about to
  lapse while renewals fail) has its job cut short and is dropped.
- at stop (`in_hand.CronRunsInHand`), the jobs in hand get a bounded grace to end; each
  still running then is cancelled and its delivery handed back as a fresh copy with its
  count carried, then acked: a stop adds nothing to the count. Left unsettled, as it was, every
  stop during a long slice counted as a crash, and five stops failed the run "delivered 5
  times without being settled". Only the job is cut short: a decision reached is carried
  out (a next slice published and the current one handed back as well would fork the run).
  A copy the broker does not confirm leaves its delivery unsettled (counted, never lost).
- at the queue's delivery limit (`x-delivery-count` and the count carried: the scheduler
  crashed or lost its connection running it that many times): the job is not run again;
  the firing is recorded `failed` with the reason, the message copied to the DLQ with that
  reason, counted `gave_up`, then ack (a run that has ended already keeps its end: dropped,
  ack; one given up whose letter is still owed is dead-lettered with the recorded reason).
  MongoDB unavailable meanwhile (a transient error, `shared.database_errors`) is waited out
  with the delivery held (`keep_trying`): a copy sent later would start its count again, and
  one returned once more is dead-lettered by RabbitMQ without a word, its firing left
  `running`. A permanent database error returns the delivery as failed.
- The job's own database work runs under `SCHEDULER_JOB_DB_TIMEOUT_S` rather than the
  client's `MONGO_TIMEOUT_S` (`services.scheduler.runs`).

`scorebox.usage-meter` (`task.completed`, `task.failed`, and its own `usage.retry`):
- unreadable body: DLQ, ack.  Recorded: ack.
- MongoDB unavailable (a transient error, `shared.database_errors`): the write is repeated
  while the delivery is held (`keep_trying`), as the status projection does: an outage of
  any length loses no usage (counted as attempts, an outage of about 45 s sent every
  completion of it to a DLQ that nothing replays).
- storing failed otherwise, a permanent database error included (a write the database
  refuses for good: a document too large, a failed validation; waited out as an outage, it
  held its delivery for ever): re-sent to the meter after a delay with an attempt counter
  (`x-scorebox-attempts`); at the limit copied to the DLQ with the error; then ack.

Every publish awaits its confirm; one the broker does not confirm (away, blocked by an alarm,
a full queue) is tried again while the delivery is held (`keep_publishing`), then the
delivery is acked; a copy to the DLQ only for `LETTER_DEADLINE_S`, after which the delivery
is returned as failed instead, not acked (`keep_dead_lettering`). Anything else that fails
the handler returns the delivery to its quorum queue as failed
(`shared.failed_deliveries.return_failed`); at its delivery limit the handler gives it up as
above, and should that fail too, `return_failed` copies it to the DLQ with the error.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from enum import StrEnum
from typing import Any

from pydantic import ValidationError
from pymongo.errors import PyMongoError

from services.scheduler.catalogue import Catalogue
from services.scheduler.config import Price
from services.scheduler.firings import FiringStore, Hold
from services.scheduler.in_hand import CronRunsInHand, CutShort
from services.scheduler.jobs import Clock, JobHandler
from services.scheduler.messaging import SchedulerBus
from services.scheduler.metering import Extras, record_task_finished
from services.scheduler.metrics import UNKNOWN_JOB, SchedulerMetrics
from services.scheduler.runs import (
    Continue,
    Defer,
    Drop,
    Finished,
    GiveUp,
    Retry,
    RetryPolicy,
    RunDecision,
    give_up_at_delivery_limit,
    run_cron_job,
)
from services.scheduler.usage_store import UsageRecords
from shared.bus import BROKER_ERRORS, error_words
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import RunCronJob, TaskCompleted, TaskFailed, new_id
from shared.database_errors import transient_database_error
from shared.failed_deliveries import return_failed
from shared.runtime import (
    LETTER_DEADLINE_S,
    keep_dead_lettering,
    keep_publishing,
    keep_trying_database,
)
from shared.topology import (
    ATTEMPTS_HEADER,
    CRON_JOBS,
    EVENT_KEY_HEADER,
    USAGE_METER,
    WorkQueue,
    carried_deliveries,
    deliveries_lost,
)

log = logging.getLogger("scorebox.scheduler.consumer")


async def _dead_letter(
    bus: SchedulerBus,
    work_queue: WorkQueue,
    message: Delivery,
    error: str,
    *,
    letter_deadline_s: float = LETTER_DEADLINE_S,
) -> bool:
    """Copy the delivery to the DLQ; True when the caller is to ack it, False when the broker
    refused the copy until `letter_deadline_s` and it was returned as failed instead."""
    return await keep_dead_lettering(
        bus.broker,
        work_queue,
        message,
        error=error,
        timeout=bus.timeout_s,
        letter_deadline_s=letter_deadline_s,
    )


# How long a delivery's hold on its run lasts unless renewed, and how often it is renewed
# while the job runs. A copy handed back at a stop whose hold could not be let go waits
# this long at most.
HOLD_LEASE = timedelta(seconds=60)
HOLD_RENEWAL_S = 15.0
# The most a stop or an outage waits to let go of a hold before handing its delivery back.
RELEASE_TIMEOUT_S = 1.0


class HoldCut(StrEnum):
    """Why a delivery's job was cut short for its hold on the run."""

    TAKEN = "taken by another delivery"
    UNRENEWED = "not renewed before its lease ran out"


class NotHandedBack(Exception):
    """A delivery cut short whose copy the broker did not confirm: left unsettled."""


@dataclass(frozen=True)
class CronJobRunner:
    handlers: Mapping[str, JobHandler]
    firings: FiringStore
    retry: RetryPolicy
    bus: SchedulerBus
    clock: Clock
    # The deadline of a handler's database work (`SCHEDULER_JOB_DB_TIMEOUT_S`).
    job_db_timeout_s: float
    metrics: SchedulerMetrics = field(default_factory=SchedulerMetrics)
    in_hand: CronRunsInHand = field(default_factory=CronRunsInHand)
    # The handlings whose job was cut short for their hold, and why.
    cut_holds: dict[str, HoldCut] = field(default_factory=dict)
    hold_lease: timedelta = HOLD_LEASE
    hold_renewal_s: float = HOLD_RENEWAL_S
    letter_deadline_s: float = LETTER_DEADLINE_S

    async def on_message(self, message: Delivery) -> bool:
        """Handle a delivery: True when the caller is to ack it, False when it was returned
        as failed already (its dead letter refused, `_dead_letter`)."""
        try:
            command = RunCronJob.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("dead-lettering an unreadable cron.run: %s", error)
            return await _dead_letter(self.bus, CRON_JOBS, message, f"unreadable cron.run: {error}")
        deliveries = deliveries_lost(message.headers)
        if deliveries >= CRON_JOBS.delivery_limit:
            decision: RunDecision | None = await self._give_up_at_delivery_limit(
                command, deliveries
            )
            handed_on = False
        else:
            decision, handed_on = await self._holding(command, message)
        if decision is None:  # handed back
            return True
        job = command.job if command.job in self.handlers else UNKNOWN_JOB
        settled = handed_on or await self.carry_out(decision, message, run_id=command.run_id)
        # Counted once carried out: a give-up counts when its letter is written, by whichever
        # delivery writes it (the one giving up, or a later one the run still owed it to).
        self.metrics.count_run(job, decision, lettered=settled)
        return settled

    async def _holding(
        self, command: RunCronJob, message: Delivery
    ) -> tuple[RunDecision | None, bool]:
        """Run the delivery under its bid for the run's hold, renewed until the run is handed
        on: its decision (None: handed back), and whether the run was handed on with it."""
        hold = Hold(
            handling=new_id(),
            message_id=command.message_id,
            step=command.step,
            until=self.clock() + self.hold_lease,
        )
        renewing = asyncio.create_task(self._keep_holding(command.run_id, hold))
        try:
            decision = await self._held_run(command, message, hold)
            handed_on = decision is not None and await self._handed_on(decision, hold)
        finally:
            renewing.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewing
        return decision, handed_on

    async def _held_run(
        self, command: RunCronJob, message: Delivery, hold: Hold
    ) -> RunDecision | None:
        """The delivery's decision; None when it was handed back instead (cut short by the
        stop, or MongoDB unavailable), its hold let go first."""
        try:
            return await self._run(command, hold)
        except CutShort:
            match self.cut_holds.pop(hold.handling, None):
                case HoldCut.TAKEN:  # another delivery carries the run on
                    return Drop(f"run {command.run_id}: this delivery lost its hold on it")
                case HoldCut.UNRENEWED:  # perhaps nobody else: sent again, as in an outage
                    await self._sent_again_later(command, message, hold)
                case None:  # the stop
                    await self._let_go(command, hold)
                    await self._hand_back(command, message)
            return None
        except PyMongoError as error:
            if not transient_database_error(error):
                raise  # counted by its queue's delivery limit, not re-sent for ever
            log.warning("MongoDB unavailable around run %s: %r", command.run_id, error)
            await self._sent_again_later(command, message, hold)
            return None

    async def _sent_again_later(self, command: RunCronJob, message: Delivery, hold: Hold) -> None:
        """Let go of the hold (if the database answers) and send the delivery again after the
        retry base delay, its deliveries carried."""
        await self._let_go(command, hold)
        later = self.clock() + self.retry.base
        again = command.model_copy(update={"message_id": new_id(), "not_before": later})
        await self._publish_run(again, headers=carried_deliveries(message.headers))

    async def _keep_holding(self, run_id: str, hold: Hold) -> None:
        """Renew the delivery's hold on the run; cut its job short once the hold may be
        another's: taken over (its renewal found it gone), or lapsed while renewals failed
        (a copy may have taken it: two would run the run at once)."""
        lasts_until = hold.until
        while True:
            await asyncio.sleep(self.hold_renewal_s)
            until = self.clock() + self.hold_lease
            try:
                # Bounded by the period: a renewal as slow as the database's own timeout
                # (up to minutes) let the lease lapse before the holder knew.
                async with asyncio.timeout(self.hold_renewal_s):
                    renewed = await self.firings.renew(
                        run_id, handling=hold.handling, until=until, now=self.clock()
                    )
            except (TimeoutError, PyMongoError) as error:
                log.warning("cron run %s: its hold not renewed: %r", run_id, error)
                # Given up before it can lapse, not after (a copy may take it at once then):
                # the next renewal may end two periods from now.
                next_known = self.clock() + timedelta(seconds=2 * self.hold_renewal_s)
                if next_known >= lasts_until:
                    self._cut(run_id, hold, HoldCut.UNRENEWED)
                continue
            if renewed:
                lasts_until = until
            else:
                self._cut(run_id, hold, HoldCut.TAKEN)

    def _cut(self, run_id: str, hold: Hold, why: HoldCut) -> None:
        # Nothing to cut before its job starts (the run being begun) or after it (handed on).
        if self.in_hand.cut_short(hold.handling):
            log.warning("cron run %s: its hold %s; its job cut short", run_id, why.value)
            self.cut_holds[hold.handling] = why

    async def _handed_on(self, decision: RunDecision, hold: Hold) -> bool:
        """Hand the run on when the decision is its next slice or retry: publish it, then
        name its step on the run (copies of this step are stale from then on, and the
        message takes the run at once: until then it waits, a few seconds at most). The
        hold is renewed meanwhile: lapsed during a long publish (a broker alarm), a copy of
        this step would take it and run the step again. False when there is nothing to hand
        on (the decision is carried out as it is)."""
        if not isinstance(decision, Continue | Retry):
            return False
        if isinstance(decision, Retry) and not decision.handing_on:
            return False
        command = decision.command
        await self._publish_run(command)
        step = command.step if command.step is not None else 0
        if not await keep_trying_database(
            lambda: self.firings.hand_on(
                command.run_id, handling=hold.handling, step=step, now=self.clock()
            ),
            what=f"handing cron run {command.run_id} on",
        ):
            # Its hold lapsed and another delivery took the run: that one carries it on, and
            # the step just published waits for it, then runs or is dropped as stale.
            log.warning("cron run %s was taken over before it was handed on", command.run_id)
        return True

    async def _let_go(self, command: RunCronJob, hold: Hold) -> None:
        """Let go of the hold before handing the delivery back, if the database answers in
        time: otherwise the copy waits for the hold to lapse (`HOLD_LEASE`)."""
        try:
            async with asyncio.timeout(RELEASE_TIMEOUT_S):
                await self.firings.release(command.run_id, handling=hold.handling)
        except (TimeoutError, PyMongoError) as error:
            log.warning("cron run %s: its hold not let go: %r", command.run_id, error)

    async def _run(self, command: RunCronJob, hold: Hold) -> RunDecision:
        return await run_cron_job(
            command,
            handlers=self.handlers,
            firings=self.firings,
            retry=self.retry,
            clock=self.clock,
            db_timeout_s=self.job_db_timeout_s,
            hold=hold,
            in_hand=self.in_hand,
        )

    async def _hand_back(self, command: RunCronJob, message: Delivery) -> None:
        """Send a fresh copy of a delivery whose job the stop cut short, its deliveries
        carried, once (the stop is bounded); `NotHandedBack` when the broker did not confirm
        it: the delivery is then left to come back."""
        again = command.model_copy(update={"message_id": new_id()})
        by = self.in_hand.hand_back_by
        try:
            async with asyncio.timeout_at(by):
                await self.bus.publish_run(again, headers=carried_deliveries(message.headers))
        except (TimeoutError, *BROKER_ERRORS) as error:
            raise NotHandedBack(repr(error)) from error
        log.info("cron run %s cut short at stop; handed back", command.run_id)

    async def _give_up_at_delivery_limit(
        self, command: RunCronJob, deliveries: int
    ) -> GiveUp | Drop | Defer:
        # Waited out with the delivery held: sent again later, it would start its count anew.
        return await keep_trying_database(
            lambda: give_up_at_delivery_limit(
                command,
                deliveries=deliveries,
                limit=CRON_JOBS.delivery_limit,
                firings=self.firings,
                clock=self.clock,
            ),
            what=f"recording cron run {command.run_id} failed at its delivery limit",
        )

    async def carry_out(self, decision: RunDecision, message: Delivery, *, run_id: str) -> bool:
        """Carry a decision about run `run_id` out: True when the caller is to ack the
        delivery, False when it was returned as failed already (a give-up whose dead letter
        was refused)."""
        match decision:
            case Continue(command=command) | Retry(command=command):
                await self._publish_run(command)
            case Defer(command=command):
                await self._publish_run(command, headers=carried_deliveries(message.headers))
            case GiveUp(reason=reason):
                log.error("dead-lettering a cron run: %s", reason)
                return await self._give_up(reason, message, run_id=run_id)
            case Drop(reason=reason):
                log.info("dropping a cron.run delivery: %s", reason)
            case Finished():
                pass
        return True

    async def _give_up(self, reason: str, message: Delivery, *, run_id: str) -> bool:
        """Dead-letter a run given up, then record its letter written; one the broker
        refused stays owed on the run (its give-up recorded it so)."""
        lettered = await _dead_letter(
            self.bus, CRON_JOBS, message, reason, letter_deadline_s=self.letter_deadline_s
        )
        if lettered:
            await self._letter_written(run_id)
        return lettered

    async def _letter_written(self, run_id: str) -> None:
        """Clear the run's owed letter, the broker having confirmed it. Should the database
        not answer, the letter stays owed: a later delivery of the run writes it again (two
        copies in the DLQ, which its drop removes together), never none."""
        try:
            await self.firings.letter_written(run_id)
        except PyMongoError as error:
            log.warning("cron run %s: its dead letter not recorded written: %r", run_id, error)

    async def _publish_run(
        self, command: RunCronJob, *, headers: Mapping[str, Any] | None = None
    ) -> None:
        await keep_publishing(
            lambda: self.bus.publish_run(command, headers=headers),
            what=f"cron run {command.run_id}",
        )


_USAGE_EVENTS: dict[str, type[TaskCompleted | TaskFailed]] = {
    TaskCompleted.routing_key: TaskCompleted,
    TaskFailed.routing_key: TaskFailed,
}


def usage_event_key(message: Delivery) -> str:
    """The task event a meter delivery holds: its routing key, or for one of the meter's own
    retries the key it had (retries sent before failures were metered name none: those
    were all `task.completed`)."""
    if message.routing_key in _USAGE_EVENTS:
        return message.routing_key
    return str(message.headers.get(EVENT_KEY_HEADER, TaskCompleted.routing_key))


@dataclass(frozen=True)
class UsageMeter:
    records: UsageRecords
    catalogue: Catalogue
    prices: Mapping[str, Price]
    bus: SchedulerBus
    clock: Clock
    max_attempts: int
    retry_after: timedelta

    async def on_message(self, message: Delivery) -> bool:
        """Record a delivery's usage: True when the caller is to ack it, False when it was
        returned as failed already (its dead letter refused, `_dead_letter`)."""
        key = usage_event_key(message)
        try:
            event = _USAGE_EVENTS[key].model_validate_json(message.body)
            raw: Any = json.loads(message.body)
        except (KeyError, ValidationError, ValueError) as error:
            log.warning("dead-lettering an unreadable %s: %s", key, error)
            return await _dead_letter(self.bus, USAGE_METER, message, f"unreadable {key}: {error}")
        extras = Extras.of(raw if isinstance(raw, dict) else {})
        try:
            await keep_trying_database(
                lambda: record_task_finished(
                    event,
                    extras=extras,
                    usage=self.records,
                    catalogue=self.catalogue,
                    prices=self.prices,
                    clock=self.clock,
                ),
                what=f"storing the usage of {event.task_id}",
            )
        except Exception as error:  # noqa: BLE001 - any failure to store is retried, then DLQ'd
            return await self._retry_or_dead_letter(event, message, error)
        return True

    async def _retry_or_dead_letter(
        self, event: TaskCompleted | TaskFailed, message: Delivery, error: Exception
    ) -> bool:
        attempts = int(message.headers.get(ATTEMPTS_HEADER, 1))
        if attempts >= self.max_attempts:
            log.error(
                "usage of task %s not stored after %d attempts: %r", event.task_id, attempts, error
            )
            reason = f"usage not stored after {attempts} attempts: {error_words(error)}"
            return await _dead_letter(self.bus, USAGE_METER, message, reason)
        log.warning("usage of task %s not stored (%r); retrying", event.task_id, error)
        await keep_publishing(
            lambda: self.bus.retry_usage_event(
                event,
                not_before=self.clock() + self.retry_after,
                headers={ATTEMPTS_HEADER: attempts + 1, EVENT_KEY_HEADER: event.routing_key},
            ),
            what=f"the usage retry of {event.task_id}",
        )
        return True


def subscribe_scheduler(
    broker: ScoreboxBroker,
    *,
    runner: CronJobRunner,
    meter: UsageMeter,
    job_concurrency: int,
    meter_prefetch: int,
    broker_timeout_s: float,
) -> None:
    @consume(broker, CRON_JOBS.queue, prefetch=job_concurrency)
    async def run_cron_job_delivery(message: Delivery) -> None:
        try:
            handled = await runner.on_message(message)
        except NotHandedBack as error:
            log.warning("a cron.run delivery cut short at stop is left unsettled: %s", error)
            return
        except Exception as error:
            log.exception("could not settle a cron.run delivery; returning it to its queue")
            await return_failed(broker, CRON_JOBS, message, error=error, timeout=broker_timeout_s)
            return
        if handled:  # else returned as failed already: its dead letter refused
            await message.ack()

    @consume(broker, USAGE_METER.queue, prefetch=meter_prefetch)
    async def record_usage_delivery(message: Delivery) -> None:
        try:
            handled = await meter.on_message(message)
        except Exception as error:
            log.exception("could not settle a usage delivery; returning it to its queue")
            await return_failed(broker, USAGE_METER, message, error=error, timeout=broker_timeout_s)
            return
        if handled:  # else returned as failed already: its dead letter refused
            await message.ack()
