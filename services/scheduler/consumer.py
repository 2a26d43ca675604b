"""The scheduler's broker adapters: decode -> handler -> carry out the decision -> ack.

`scorebox.cron-jobs` (`RunCronJob`):
- unreadable body: copied to the DLQ with the validation error, then ack.
- Finished / Drop: ack.  Continue: next slice published, then ack.
- Retry / Defer: published down the wait ladder, then ack.
- GiveUp: copied to the DLQ with the reason (`x-scorebox-error`), then ack.
- MongoDB unavailable around the job (recording its start or outcome; a transient error):
  the same command (its message id kept, so the firing still awaits it) is re-sent after the
  retry base delay without counting an attempt, handed back by this delivery's handling
  (`x-scorebox-handed-back-by`, which lets it in past the run's hold), then ack. A
  permanent database error there (a result the database refuses) returns the delivery to
  its queue as failed, so its delivery limit bounds it: re-sent uncounted, it came back
  every few seconds for ever.
- a copy of the delivery's own run sent again (Defer, MongoDB unavailable, a stop) carries
  the deliveries its consumers lost so far (`x-scorebox-earlier-deliveries`), for the copy's
  own count starts at zero; a next slice or retry is a new message and carries none.
- at stop (`CronRunsInHand`), the runs in hand get a bounded grace to end; each still running
  then is cancelled and handed back as a fresh copy of its delivery, under the same message
  id, with its count carried and `x-scorebox-handed-back-by`, then acked: a stop adds nothing
  to the count. Left unsettled, as it was, every stop during a long slice counted as a
  crash, and five stops failed the run "delivered 5 times without being settled". A copy
  the broker does not confirm in time leaves its delivery unsettled (counted, never lost).
- a delivery's handling is told apart from other copies of its message (`RunDelivery`): a
  broker redelivery (`redelivered`, `x-delivery-count`) takes the run over from the handling
  that died with it, and so does a copy one hands back (`x-scorebox-takes-over`); any other
  copy is refused while a handling holds the run (`services.scheduler.firings`).
- at the queue's delivery limit (`x-delivery-count` and the count carried: the scheduler
  crashed or lost its connection running it that many times): the job is not run again;
  the firing is recorded `failed` with the reason, the message copied to the DLQ with that
  reason, counted `gave_up`, then ack (a run that has ended already keeps its end: dropped,
  ack). MongoDB unavailable meanwhile (a transient error, `shared.database_errors`) is
  waited out with the delivery held (`keep_trying`): a copy sent later would start its
  count again, and one returned once more is dead-lettered by RabbitMQ without a word, its
  firing left `running`. A permanent database error returns the delivery as failed.
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
delivery is acked. Anything else that fails the handler returns the delivery to its quorum
queue as failed (`shared.failed_deliveries.return_failed`); at its delivery limit the handler
gives it up as above, and should that fail too, `return_failed` copies it to the DLQ with
the error.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Coroutine, Mapping
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pydantic import ValidationError
from pymongo.errors import PyMongoError

from services.scheduler.catalogue import Catalogue
from services.scheduler.config import Price
from services.scheduler.firings import FiringStore, RunDelivery
from services.scheduler.jobs import Clock, JobHandler
from services.scheduler.messaging import SchedulerBus
from services.scheduler.metering import Extras, record_task_finished
from services.scheduler.metrics import UNKNOWN_JOB, SchedulerMetrics
from services.scheduler.runs import (
    DEFAULT_STALE_AFTER,
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
from shared.bus import BROKER_ERRORS
from shared.consumers import Delivery, ScoreboxBroker, consume
from shared.contracts import RunCronJob, TaskCompleted, TaskFailed, new_id
from shared.database_errors import transient_database_error
from shared.failed_deliveries import return_failed
from shared.runtime import keep_dead_lettering, keep_publishing, keep_trying_database
from shared.topology import (
    ATTEMPTS_HEADER,
    CRON_JOBS,
    DELIVERY_COUNT_HEADER,
    EVENT_KEY_HEADER,
    USAGE_METER,
    WorkQueue,
    carried_deliveries,
    deliveries_lost,
)

log = logging.getLogger("scorebox.scheduler.consumer")
# Names the handling that handed a copy of its delivery back (a stop, a database outage): the
# copy takes the run over from it.
HANDED_BACK_BY_HEADER = "x-scorebox-handed-back-by"
# Marks a copy handed back by a delivery that took its run over (a redelivery): the copy
# takes it over too, from the handling that died, which it does not name.
TAKES_OVER_HEADER = "x-scorebox-takes-over"


def takes_over(message: Delivery) -> bool:
    """Whether `message` takes its run over from whoever held it: a broker redelivery (its
    consumer died holding it), or a copy handed back by one."""
    count = int(message.headers.get(DELIVERY_COUNT_HEADER, 0))
    return message.redelivered or count > 0 or bool(message.headers.get(TAKES_OVER_HEADER))


def run_delivery(command: RunCronJob, message: Delivery, handling: str) -> RunDelivery:
    """How `command` reached this process, as the firing's fence reads it."""
    replaces = message.headers.get(HANDED_BACK_BY_HEADER)
    return RunDelivery(
        command.message_id,
        handling=handling,
        takes_over=takes_over(message),
        replaces=None if replaces is None else str(replaces),
    )


async def _dead_letter(
    bus: SchedulerBus, work_queue: WorkQueue, message: Delivery, error: str
) -> None:
    await keep_dead_lettering(bus.broker, work_queue, message, error=error, timeout=bus.timeout_s)


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
    # How long a silent handling of a run keeps other copies out (`SCHEDULER_RUN_STALE_S`).
    stale_after: timedelta = DEFAULT_STALE_AFTER

    async def on_message(self, message: Delivery, *, handling: str | None = None) -> None:
        """Handle one delivery; `handling` names this handling of it (one is drawn if None)."""
        handling = handling or new_id()
        try:
            command = RunCronJob.model_validate_json(message.body)
        except ValidationError as error:
            log.warning("dead-lettering an unreadable cron.run: %s", error)
            await _dead_letter(self.bus, CRON_JOBS, message, f"unreadable cron.run: {error}")
            return
        deliveries = deliveries_lost(message.headers)
        if deliveries >= CRON_JOBS.delivery_limit:
            decision: RunDecision = await self._give_up_at_delivery_limit(command, deliveries)
        else:
            try:
                decision = await self._run(command, run_delivery(command, message, handling))
            except PyMongoError as error:
                if not transient_database_error(error):
                    raise  # counted by its queue's delivery limit, not re-sent for ever
                log.warning("MongoDB unavailable around run %s: %r", command.run_id, error)
                later = self.clock() + self.retry.base
                again = command.model_copy(update={"not_before": later})
                await self._publish_run(again, headers=handed_back(message, handling))
                return
        job = command.job if command.job in self.handlers else UNKNOWN_JOB
        self.metrics.count_run(job, decision)
        await self.carry_out(decision, message)

    async def _run(self, command: RunCronJob, delivery: RunDelivery) -> RunDecision:
        return await run_cron_job(
            command,
            handlers=self.handlers,
            firings=self.firings,
            retry=self.retry,
            clock=self.clock,
            db_timeout_s=self.job_db_timeout_s,
            delivery=delivery,
            stale_after=self.stale_after,
        )

    async def hand_back(self, message: Delivery, *, handling: str) -> bool:
        """Send a fresh copy of a delivery whose handling `handling` was cut short at stop,
        its deliveries carried, once (the stop is bounded); False when the broker did not
        confirm it or the body is unreadable: the delivery is then left to come back."""
        try:
            command = RunCronJob.model_validate_json(message.body)
            await self.bus.publish_run(command, headers=handed_back(message, handling))
        except (ValidationError, *BROKER_ERRORS) as error:
            log.warning("a cron.run delivery cut short at stop is left unsettled: %r", error)
            return False
        log.info("cron run %s cut short at stop; handed back", command.run_id)
        return True

    async def _give_up_at_delivery_limit(
        self, command: RunCronJob, deliveries: int
    ) -> GiveUp | Drop:
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

    async def carry_out(self, decision: RunDecision, message: Delivery) -> None:
        match decision:
            case Continue(command=command) | Retry(command=command):
                await self._publish_run(command)
            case Defer(command=command):
                await self._publish_run(command, headers=carried_deliveries(message.headers))
            case GiveUp(reason=reason):
                log.error("dead-lettering a cron run: %s", reason)
                await _dead_letter(self.bus, CRON_JOBS, message, reason)
            case Drop(reason=reason):
                log.info("dropping a cron.run delivery: %s", reason)
            case Finished():
                pass

    async def _publish_run(
        self, command: RunCronJob, *, headers: Mapping[str, Any] | None = None
    ) -> None:
        await keep_publishing(
            lambda: self.bus.publish_run(command, headers=headers),
            what=f"cron run {command.run_id}",
        )


def handed_back(message: Delivery, handling: str) -> dict[str, Any]:
    """The headers of a copy of `message` that its handling `handling` hands back."""
    headers = {**carried_deliveries(message.headers), HANDED_BACK_BY_HEADER: handling}
    if takes_over(message):
        headers[TAKES_OVER_HEADER] = True
    return headers


class CronRunsInHand:
    """The cron deliveries this process is handling, for its stop: those still running after
    a grace are cancelled and handed back (`CronJobRunner.hand_back`) rather than left for
    the broker to return, which counts towards the queue's delivery limit."""

    def __init__(self) -> None:
        self._running: set[asyncio.Task[None]] = set()
        self._cut_short: set[asyncio.Task[None]] = set()
        self._closed = False

    async def run(self, handling: Coroutine[Any, Any, None]) -> bool:
        """Run a delivery's handling; False when the stop cut it short (or came first)."""
        if self._closed:
            handling.close()
            return False
        task = asyncio.ensure_future(handling)
        self._running.add(task)
        try:
            await task
        except asyncio.CancelledError:
            if task in self._cut_short and not _being_cancelled():
                return False
            task.cancel()
            raise
        finally:
            self._running.discard(task)
            self._cut_short.discard(task)
        return True

    async def cut_short_after(self, grace_s: float) -> int:
        """Take no more; wait up to `grace_s` for the handlings in hand, then cancel the rest
        (each hands its delivery back); how many were cut short."""
        self._closed = True
        if not self._running:
            return 0
        _, late = await asyncio.wait(set(self._running), timeout=grace_s)
        for task in late:
            self._cut_short.add(task)
            task.cancel()
        return len(late)


def _being_cancelled() -> bool:
    current = asyncio.current_task()
    return current is not None and current.cancelling() > 0


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

    async def on_message(self, message: Delivery) -> None:
        key = usage_event_key(message)
        try:
            event = _USAGE_EVENTS[key].model_validate_json(message.body)
            raw: Any = json.loads(message.body)
        except (KeyError, ValidationError, ValueError) as error:
            log.warning("dead-lettering an unreadable %s: %s", key, error)
            await _dead_letter(self.bus, USAGE_METER, message, f"unreadable {key}: {error}")
            return
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
            await self._retry_or_dead_letter(event, message, error)

    async def _retry_or_dead_letter(
        self, event: TaskCompleted | TaskFailed, message: Delivery, error: Exception
    ) -> None:
        attempts = int(message.headers.get(ATTEMPTS_HEADER, 1))
        if attempts >= self.max_attempts:
            log.error(
                "usage of task %s not stored after %d attempts: %r", event.task_id, attempts, error
            )
            reason = f"usage not stored after {attempts} attempts: {error!r}"
            await _dead_letter(self.bus, USAGE_METER, message, reason)
            return
        log.warning("usage of task %s not stored (%r); retrying", event.task_id, error)
        await keep_publishing(
            lambda: self.bus.retry_usage_event(
                event,
                not_before=self.clock() + self.retry_after,
                headers={ATTEMPTS_HEADER: attempts + 1, EVENT_KEY_HEADER: event.routing_key},
            ),
            what=f"the usage retry of {event.task_id}",
        )


def subscribe_scheduler(
    broker: ScoreboxBroker,
    *,
    runner: CronJobRunner,
    meter: UsageMeter,
    job_concurrency: int,
    meter_prefetch: int,
    broker_timeout_s: float,
    in_hand: CronRunsInHand | None = None,
) -> None:
    runs_in_hand = in_hand or CronRunsInHand()

    @consume(broker, CRON_JOBS.queue, prefetch=job_concurrency)
    async def run_cron_job_delivery(message: Delivery) -> None:
        handling = new_id()
        try:
            ended = await runs_in_hand.run(runner.on_message(message, handling=handling))
        except Exception as error:
            log.exception("could not settle a cron.run delivery; returning it to its queue")
            await return_failed(broker, CRON_JOBS, message, error=error, timeout=broker_timeout_s)
            return
        if ended or await runner.hand_back(message, handling=handling):
            await message.ack()

    @consume(broker, USAGE_METER.queue, prefetch=meter_prefetch)
    async def record_usage_delivery(message: Delivery) -> None:
        try:
            await meter.on_message(message)
        except Exception as error:
            log.exception("could not settle a usage delivery; returning it to its queue")
            await return_failed(broker, USAGE_METER, message, error=error, timeout=broker_timeout_s)
            return
        await message.ack()
