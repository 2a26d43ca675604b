"""At the cron queue's delivery limit the scheduler gives the run up itself, with a reason.

A `RunCronJob` whose scheduler crashed or lost its connection running it comes back with
`x-delivery-count`; at the queue's limit it is handed once more, and RabbitMQ dead-letters
it without a word if it comes back again. Run again, the job most likely took the scheduler
down once more, and its firing stayed `running` for ever: `GET /admin/v1/cron/runs/{id}`
never said it failed. Now the job is not run: the firing is recorded `failed` with the
reason, the message copied to the DLQ with it, and the delivery acked.

The first test plays the dying schedulers on the real broker (a consumer that takes the
message and closes its connection holding it, as many times as the limit), then lets a real
scheduler have it. The others hand the cron consumer a delivery at the limit as the broker
would (`HandedDelivery`), on the real broker and database.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from datetime import datetime, timedelta
from typing import Any

import aio_pika
import pytest
from prometheus_client import CollectorRegistry
from pymongo.errors import AutoReconnect

from services.scheduler.catalogue import Catalogue
from services.scheduler.config import parse_config
from services.scheduler.consumer import CronJobRunner, UsageMeter, subscribe_scheduler
from services.scheduler.errors import PermanentJobError
from services.scheduler.firings import Firing, Firings, FiringState, Held, Hold
from services.scheduler.jobs import JobOutcome, JobRun
from services.scheduler.messaging import SchedulerBus
from services.scheduler.metrics import SchedulerMetrics
from services.scheduler.runs import RetryPolicy
from services.scheduler.usage_store import UsageRecords
from shared.consumers import Delivery
from shared.contracts import RunCronJob
from shared.runtime import LETTER_DEADLINE_S, make_broker
from shared.topology import (
    CRON_JOBS,
    DELIVERY_COUNT_HEADER,
    EARLIER_DELIVERIES_HEADER,
    ERROR_HEADER,
    declare_topology,
)
from tests.integration import test_scheduler
from tests.integration.test_failed_deliveries import _delete_queue
from tests.integration.test_scheduler import QUIET, Calls, Env, firing_state, scheduler
from tests.support import HandedDelivery, drain, eventually, sample

mongo_client = test_scheduler.mongo_client  # fixtures
topology = test_scheduler.topology
env = test_scheduler.env

JOB = "crashing"
LIMIT = CRON_JOBS.delivery_limit
RESULTS = ("gave_up", "letter_refused")


async def _left_running(env: Env, firings: Firings) -> RunCronJob:
    """A firing a scheduler started and died in: `running`, its command due."""
    await firings.ensure_indexes()
    at = QUIET - timedelta(minutes=5)
    firing = await firings.claim(JOB, at, now=at, owner="dead-scheduler", manual=True)
    assert firing is not None
    assert await firings.begin(firing.run_id, attempt=1, now=at) is not None
    return RunCronJob(task_id=firing.run_id, job=JOB, scheduled_for=at, fired_at=at, manual=True)


async def _published(env: Env, command: RunCronJob) -> None:
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        await SchedulerBus(broker, 10, env.clock).publish_run(command)


async def _held_by_a_scheduler_that_dies(amqp_url: str) -> int:
    """Take the cron run, then close the connection holding it (a scheduler dying in the
    job); the delivery count it was handed with."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel()
        queue = await channel.get_queue(CRON_JOBS.name, ensure=True)

        async def handed() -> tuple[aio_pika.abc.AbstractIncomingMessage] | None:
            message = await queue.get(no_ack=False, fail=False, timeout=5)
            return None if message is None else (message,)

        (message,) = await eventually(handed, what="the cron run handed to a consumer")
        return int(str(message.headers.get(DELIVERY_COUNT_HEADER, 0)))


async def _dead_letters(amqp_url: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    async def found() -> list[aio_pika.abc.AbstractIncomingMessage] | None:
        return await drain(amqp_url, CRON_JOBS.dead_letter_routing_key) or None

    return await eventually(found, what="the cron run in the DLQ")


async def test_a_run_whose_scheduler_died_up_to_the_limit_is_failed_and_dead_lettered(
    env: Env,
) -> None:
    await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
    command = await _left_running(env, Firings(env.mongo, env.database))
    await _published(env, command)
    counts = [await _held_by_a_scheduler_that_dies(env.amqp_url) for _ in range(LIMIT)]
    assert counts == list(range(LIMIT))  # handed next with `x-delivery-count` at the limit
    config = parse_config({"jobs": {JOB: {"cron": "0 3 * * *", "enabled": False}}}, {})
    calls = Calls()

    gave_up = f'scorebox_cron_runs_total{{job="{JOB}",result="gave_up"}} 1.0'
    async with scheduler(env, config, handlers={JOB: calls}) as (api, _):
        run = await firing_state(api, command.run_id, "failed")
        [letter] = await _dead_letters(env.amqp_url)

        async def counted() -> bool:
            # Counted once the letter is recorded written on the run: after the letter's
            # confirm and the run's failure this test saw (a flake in CI read it too soon).
            return gave_up in (await api.get("/metrics")).text

        await eventually(counted, timeout_s=10, what="the give-up counted")

    assert calls.runs == []  # not run again
    assert f"delivered {LIMIT} times without being settled" in run["error"]
    assert f"delivery limit {LIMIT} reached" in run["error"]
    assert str(letter.headers[ERROR_HEADER]) == run["error"]
    assert RunCronJob.model_validate_json(letter.body).run_id == command.run_id
    # Acked: neither left in its queue nor dead-lettered again by RabbitMQ.
    assert await drain(env.amqp_url, CRON_JOBS.name) == []
    assert await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key) == []


class AwayOnce(Firings):
    """The firings, the database away the first time a run's end is recorded."""

    away = True

    async def finish(
        self,
        run_id: str,
        *,
        state: FiringState,
        now: datetime,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        letter_owed: bool = False,
    ) -> bool:
        if self.away:
            self.away = False
            raise AutoReconnect("the database is away")
        return await super().finish(
            run_id, state=state, now=now, result=result, error=error, letter_owed=letter_owed
        )


Handler = Callable[[Delivery], Coroutine[Any, Any, None]]
# The cron consumer's handler over the given firings, with the given job as `JOB` (and how long
# a dead letter's copy is tried, as a keyword).
CronConsumer = Callable[..., Handler]


class Consumers:
    """Takes the handlers `subscribe_scheduler` registers, by queue, as a broker would."""

    def __init__(self) -> None:
        self.handlers: dict[str, Handler] = {}

    def add_consumer(self, subscription: Any) -> None:
        self.handlers[subscription.queue.name] = subscription.handler


@pytest.fixture
async def cron_consumer(env: Env) -> AsyncIterator[CronConsumer]:
    """The cron consumer's handler, publishing on the real broker."""
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        bus = SchedulerBus(broker, 10, env.clock)

        def handler(
            firings: Firings,
            job: Calls,
            *,
            letter_deadline_s: float = LETTER_DEADLINE_S,
            metrics: SchedulerMetrics | None = None,
        ) -> Handler:
            consumers = Consumers()
            runner = CronJobRunner(
                handlers={JOB: job},
                firings=firings,
                retry=RetryPolicy(3, timedelta(seconds=1), timedelta(seconds=10)),
                bus=bus,
                clock=env.clock,
                job_db_timeout_s=10,
                metrics=metrics or SchedulerMetrics(CollectorRegistry()),
                letter_deadline_s=letter_deadline_s,
            )
            meter = UsageMeter(
                records=UsageRecords(env.mongo, env.database),
                catalogue=Catalogue(env.mongo, env.database),
                prices={},
                bus=bus,
                clock=env.clock,
                max_attempts=3,
                retry_after=timedelta(seconds=1),
            )
            subscribe_scheduler(
                consumers,  # type: ignore[arg-type]
                runner=runner,
                meter=meter,
                job_concurrency=1,
                meter_prefetch=1,
                broker_timeout_s=5.0,
            )
            return consumers.handlers[CRON_JOBS.name]

        yield handler


def _at_the_limit(command: RunCronJob) -> HandedDelivery:
    return HandedDelivery.redelivery(command.model_dump_json().encode(), count=LIMIT)


async def test_a_database_away_at_the_limit_is_waited_out_with_the_delivery_held(
    env: Env, cron_consumer: CronConsumer
) -> None:
    """Returned as failed instead, the delivery would come back once more and RabbitMQ would
    dead-letter it without a word, its firing left `running`."""
    await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
    firings = AwayOnce(env.mongo, env.database)
    command = await _left_running(env, firings)
    calls = Calls()
    message = _at_the_limit(command)

    await asyncio.wait_for(cron_consumer(firings, calls)(message), timeout=30)

    assert not firings.away  # it was away, and waited out
    assert message.settled == ["ack"]
    assert calls.runs == []
    firing = await firings.find(command.run_id)
    assert firing is not None
    assert firing.state is FiringState.FAILED
    assert f"delivery limit {LIMIT} reached" in (firing.error or "")
    [letter] = await _dead_letters(env.amqp_url)
    assert str(letter.headers[ERROR_HEADER]) == firing.error


async def test_a_run_that_ended_before_the_limit_keeps_its_outcome(
    env: Env, cron_consumer: CronConsumer
) -> None:
    """It succeeded, and the scheduler died each time before acking the delivery: the first
    end stands, the job is not run again, and the delivery is dropped: no dead letter says
    that a run which succeeded was given up."""
    await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
    firings = Firings(env.mongo, env.database)
    command = await _left_running(env, firings)
    await firings.finish(command.run_id, state=FiringState.SUCCEEDED, now=QUIET, result={"n": 1})
    calls = Calls()
    message = _at_the_limit(command)

    await asyncio.wait_for(cron_consumer(firings, calls)(message), timeout=30)

    assert message.settled == ["ack"]
    assert calls.runs == []
    firing = await firings.find(command.run_id)
    assert firing is not None
    assert (firing.state, firing.result, firing.error) == (FiringState.SUCCEEDED, {"n": 1}, None)
    # The handler has returned: a letter it sent would have been confirmed by now.
    assert await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key) == []


class AwayAtBegin(Firings):
    """The firings, the database away the next time a run is started once `away` is set."""

    away = False

    async def begin(
        self, run_id: str, *, attempt: int, now: datetime, hold: Hold | None = None
    ) -> Firing | Held | None:
        if self.away:
            self.away = False
            raise AutoReconnect("the database is away")
        return await super().begin(run_id, attempt=attempt, now=now, hold=hold)


async def test_a_redelivery_sent_again_on_a_database_error_carries_its_count(
    env: Env, cron_consumer: CronConsumer
) -> None:
    """A fresh copy starts its `x-delivery-count` at zero: sent again without the count, a run
    that kills its scheduler would loop for ever whenever a database error fell on one of
    its redeliveries."""
    await drain(env.amqp_url, CRON_JOBS.name)
    firings = AwayAtBegin(env.mongo, env.database)
    command = await _left_running(env, firings)
    firings.away = True
    calls = Calls()
    message = HandedDelivery(
        command.model_dump_json().encode(),
        headers={DELIVERY_COUNT_HEADER: 2, EARLIER_DELIVERIES_HEADER: 1},
        redelivered=True,
    )

    await asyncio.wait_for(cron_consumer(firings, calls)(message), timeout=30)

    assert not firings.away
    assert message.settled == ["ack"]
    assert calls.runs == []

    async def sent_again() -> list[aio_pika.abc.AbstractIncomingMessage] | None:
        return await drain(env.amqp_url, CRON_JOBS.name) or None

    [copy] = await eventually(sent_again, what="the run sent again after its retry delay")
    assert RunCronJob.model_validate_json(copy.body).run_id == command.run_id
    assert copy.headers[EARLIER_DELIVERIES_HEADER] == 3  # carried 1, and 2 on this copy


async def test_the_limit_counts_the_deliveries_carried_from_earlier_copies(
    env: Env, cron_consumer: CronConsumer
) -> None:
    await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
    firings = Firings(env.mongo, env.database)
    command = await _left_running(env, firings)
    calls = Calls()
    message = HandedDelivery(
        command.model_dump_json().encode(),
        headers={DELIVERY_COUNT_HEADER: 1, EARLIER_DELIVERIES_HEADER: LIMIT - 1},
        redelivered=True,
    )

    await asyncio.wait_for(cron_consumer(firings, calls)(message), timeout=30)

    assert message.settled == ["ack"]
    assert calls.runs == []  # not run again
    firing = await firings.find(command.run_id)
    assert firing is not None
    assert firing.state is FiringState.FAILED
    assert f"delivered {LIMIT} times without being settled" in (firing.error or "")
    [letter] = await _dead_letters(env.amqp_url)
    assert str(letter.headers[ERROR_HEADER]) == firing.error


async def test_a_give_up_whose_letter_was_refused_is_dead_lettered_when_it_comes_back(
    env: Env, cron_consumer: CronConsumer
) -> None:
    """The DLQ deleted, the give-up's copy is refused and the delivery returned as failed;
    when it comes back its run has ended, and it was dropped: the run failed with no letter
    to replay. With the DLQ back, the returned delivery is dead-lettered with its reason,
    here by another replica: the letter is owed on the run (`letter_owed`), not in the
    memory of the process that gave it up."""
    await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
    firings = Firings(env.mongo, env.database)
    command = await _left_running(env, firings)
    calls = Calls()
    body, message_id = command.model_dump_json().encode(), command.message_id
    at_limit = HandedDelivery(
        body, headers={DELIVERY_COUNT_HEADER: LIMIT}, redelivered=True, message_id=message_id
    )
    registry = CollectorRegistry()
    metrics = SchedulerMetrics(registry)  # both replicas' counts, together
    giving_up = cron_consumer(firings, calls, letter_deadline_s=0.3, metrics=metrics)
    await _refused(env, giving_up, at_limit)
    refused = await firings.find(command.run_id)
    returned = HandedDelivery(
        body, headers={DELIVERY_COUNT_HEADER: LIMIT + 1}, redelivered=True, message_id=message_id
    )
    await asyncio.wait_for(cron_consumer(firings, calls, metrics=metrics)(returned), timeout=30)

    assert at_limit.settled == ["reject(requeue=True)"]
    assert returned.settled == ["ack"]
    assert calls.runs == []
    assert refused is not None
    assert refused.owes_letter
    await _dead_lettered_once(env, firings, command.run_id)
    # One run given up, one letter: one give-up, counted where the letter was written.
    counted = {
        result: sample(registry, "scorebox_cron_runs_total", job=JOB, result=result)
        for result in RESULTS
    }
    assert counted == {"gave_up": 1, "letter_refused": 1}


async def test_a_give_up_of_its_job_whose_letter_was_refused_is_dead_lettered_by_another_replica(
    env: Env, cron_consumer: CronConsumer
) -> None:
    """As above, for a run its job gave up (not at the delivery limit): the returned
    delivery begins nothing, finds the letter owed, and writes it."""
    await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
    firings = Firings(env.mongo, env.database)
    command = await _left_running(env, firings)
    body, message_id = command.model_dump_json().encode(), command.message_id
    first = HandedDelivery(body, message_id=message_id)
    await _refused(env, cron_consumer(firings, _misconfigured, letter_deadline_s=0.3), first)
    returned = HandedDelivery(
        body, headers={DELIVERY_COUNT_HEADER: 1}, redelivered=True, message_id=message_id
    )
    await asyncio.wait_for(cron_consumer(firings, _misconfigured)(returned), timeout=30)

    assert first.settled == ["reject(requeue=True)"]
    assert returned.settled == ["ack"]
    firing = await _dead_lettered_once(env, firings, command.run_id)
    assert "configuration missing" in (firing.error or "")


class LosesTheAnswerOnce(Firings):
    """The firings, the answer to the first write of a run's end lost once it applied (a
    connection reset after the write: a transient error)."""

    lost = False

    async def finish(
        self,
        run_id: str,
        *,
        state: FiringState,
        now: datetime,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        letter_owed: bool = False,
    ) -> bool:
        applied = await super().finish(
            run_id, state=state, now=now, result=result, error=error, letter_owed=letter_owed
        )
        if not self.lost:
            self.lost = True
            raise AutoReconnect("connection reset after the write")
        return applied


async def test_a_give_up_whose_failed_mark_lost_its_answer_is_dead_lettered_by_its_copy(
    env: Env, cron_consumer: CronConsumer
) -> None:
    """The give-up's write applied and its answer lost, the delivery is sent again as in a
    database outage; the copy found the run failed and was dropped: failed for good, no
    letter to replay, no DLQ alert (found in review). Now the copy, due and taken by another
    replica, is dead-lettered with the recorded reason."""
    await drain(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
    await drain(env.amqp_url, CRON_JOBS.name)
    firings = LosesTheAnswerOnce(env.mongo, env.database)
    command = await _left_running(env, firings)
    first = HandedDelivery(command.model_dump_json().encode(), message_id=command.message_id)

    await asyncio.wait_for(cron_consumer(firings, _misconfigured)(first), timeout=30)
    sent_again = await _sent_again(env, command.run_id)
    env.clock.now = RunCronJob.model_validate_json(sent_again.body).not_before or env.clock.now
    copy = HandedDelivery(
        sent_again.body, headers=dict(sent_again.headers), message_id=sent_again.message_id
    )
    other_replica = cron_consumer(Firings(env.mongo, env.database), _misconfigured)
    await asyncio.wait_for(other_replica(copy), timeout=30)

    assert firings.lost
    assert (first.settled, copy.settled) == (["ack"], ["ack"])
    firing = await _dead_lettered_once(env, firings, command.run_id)
    assert "configuration missing" in (firing.error or "")


async def _misconfigured(run: JobRun) -> JobOutcome:
    raise PermanentJobError("configuration missing")


async def _refused(env: Env, handle: Handler, delivery: HandedDelivery) -> None:
    """Hand `delivery` over while the cron DLQ is deleted (its dead letter refused)."""
    await _delete_queue(env.amqp_url, CRON_JOBS.dead_letter_routing_key)
    try:
        await asyncio.wait_for(handle(delivery), timeout=30)
    finally:
        await _declare_topology(env)  # the DLQ back


async def _sent_again(env: Env, run_id: str) -> aio_pika.abc.AbstractIncomingMessage:
    """The run's copy sent again down the wait ladder, once it reached the cron queue."""

    async def arrived() -> list[aio_pika.abc.AbstractIncomingMessage] | None:
        found = await drain(env.amqp_url, CRON_JOBS.name)
        ours = [m for m in found if RunCronJob.model_validate_json(m.body).run_id == run_id]
        return ours or None

    [copy] = await eventually(arrived, what=f"run {run_id} sent again")
    return copy


async def _dead_lettered_once(env: Env, firings: Firings, run_id: str) -> Firing:
    """The run, failed with its one dead letter written (and recorded written)."""
    firing = await firings.find(run_id)
    assert firing is not None
    assert firing.state is FiringState.FAILED
    assert not firing.letter_owed
    [letter] = await _dead_letters(env.amqp_url)
    assert str(letter.headers[ERROR_HEADER]) == firing.error
    assert RunCronJob.model_validate_json(letter.body).run_id == run_id
    return firing


async def _declare_topology(env: Env) -> None:
    broker = make_broker(env.settings())
    async with broker:
        await broker.connect()
        await declare_topology(broker)
