"""Composition root of the scorer: the `score.requested` consumer and its model, the
`score.cancel` consumer, the batch cancellations it keeps, and the rate-limit pauses it
shares with the other replicas."""

from __future__ import annotations

import asyncio
import logging
import os
import random
import socket
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta
from functools import partial

from fastapi import FastAPI

from services.scorer.attempts import Attempts
from services.scorer.batch_cancels import (
    BatchCancelRecords,
    CancelledBatches,
    recall_again,
    recall_cancelled_batches,
    subscribe_batch_cancels,
)
from services.scorer.cancels import (
    CANCELS_FIRST_S,
    TaskCancels,
    cancels_handled_first,
    subscribe_cancels,
)
from services.scorer.consumer import BrokerActions, subscribe_scorer
from services.scorer.metrics import ScorerMetrics
from services.scorer.model import ProviderClient, ScoreModel, build_model, make_http_client
from services.scorer.model.settings import ModelSettings
from services.scorer.provider_checks import provider_checks
from services.scorer.scoring import RetryPolicy, ScorerDeps
from services.scorer.settings import ScorerSettings
from services.scorer.shared_pauses import PauseAnnouncer, provider_of, subscribe_shared_pauses
from services.scorer.slots import ModelSlots
from services.scorer.throttle import ModelThrottle
from shared.bus import publish_event, publish_ops_event
from shared.clock_offset import DatabaseClock
from shared.consumers import ScoreboxBroker
from shared.contracts import new_id
from shared.runtime import (
    MongoClient,
    clock_watch_of,
    make_broker,
    make_mongo,
    prepare_service_database,
    start_broker,
)
from shared.service_app import internal_service_app
from shared.settings import BROKER_CONSUMER_TIMEOUT_S, StartupRefused

log = logging.getLogger("scorebox.scorer")


def stop_grace_s(settings: ScorerSettings, model_settings: ModelSettings) -> float:
    """How long the deliveries in hand get to finish at stop: the whole path of one that
    just took a model slot, each step at its bound (85 s by default).

    Cut short, the lifespan closed the model client and the database under a decision still
    running (it is shielded): a call thrown away, or recorded as a retry of an unavailable
    model. The call's timeout and two confirms were counted, not the claim and the
    `spent_before` read before the call, the `task.started` confirm that may follow it, nor
    the decision's write. A database or broker outage is not covered: its waits have no end.
    """
    mongo_s, broker_s = settings.mongo_timeout_s, settings.broker_timeout_s
    before_the_call = 2 * mongo_s  # the claim, then `spent_before`
    # `task.started` is confirmed before the call returns: with `started_after` 0 before
    # the call, else from then on, up to its publish timeout past a call that ends early.
    the_call = model_settings.llm_timeout_s + broker_s
    # The decision recorded, then two confirms, the outcome's after the batch of completions
    # in flight ahead of it (`shared.batched_publish`).
    after_the_call = mongo_s + 3 * broker_s
    return before_the_call + the_call + after_the_call


def lease_s(settings: ScorerSettings, model_settings: ModelSettings) -> float:
    """How long a claim holds an attempt: its call and the repair's, and the margin."""
    return model_settings.llm_timeout_s * 2 + settings.lease_margin_s


def longest_hold_s(settings: ScorerSettings, model_settings: ModelSettings) -> float:
    """The longest a delivery is held unacknowledged: a redelivery waits out another
    worker's claim, then its turn under a rate limit's pause (`RATE_LIMIT_HOLD_S`), then
    takes the whole path of a delivery that just took a model slot (`stop_grace_s`). Not
    counted: its wait for a model slot when more deliveries are in hand than slots."""
    return (
        lease_s(settings, model_settings)
        + settings.rate_limit_hold_s
        + stop_grace_s(settings, model_settings)
    )


def refuse_a_hold_past_the_consumer_timeout(
    settings: ScorerSettings, model_settings: ModelSettings
) -> None:
    """Past RabbitMQ's consumer timeout the broker closes the channel and takes back every
    delivery in hand (from 4.3, the message comes back while its handler still runs).
    `LLM_TIMEOUT_S` alone was bounded, leaving out the hold and the steps around the call
    (review of the scorer)."""
    held_s = longest_hold_s(settings, model_settings)
    if held_s >= BROKER_CONSUMER_TIMEOUT_S:
        raise StartupRefused(
            f"a redelivery could be held {held_s:g} s, past RabbitMQ's consumer timeout "
            f"({BROKER_CONSUMER_TIMEOUT_S:g} s): lower LLM_TIMEOUT_S, LEASE_MARGIN_S, "
            "RATE_LIMIT_HOLD_S, MONGO_TIMEOUT_S or BROKER_TIMEOUT_S"
        )


def lease_warning(settings: ScorerSettings, model_settings: ModelSettings) -> str | None:
    """What to warn of when the lease may end before its decision is written: under the
    claim come a read, the call, a confirm and the decision's write, and the replicas'
    clocks may differ by twice `MAX_CLOCK_OFFSET_S`; a redelivery then takes the attempt
    over and calls the model again (one outcome all the same, two calls billed)."""
    steps_s = 2 * settings.mongo_timeout_s + settings.broker_timeout_s
    needed_s = steps_s + 2 * settings.max_clock_offset_s
    if model_settings.llm_timeout_s + settings.lease_margin_s >= needed_s:
        return None
    return (
        f"LEASE_MARGIN_S ({settings.lease_margin_s:g}) with LLM_TIMEOUT_S "
        f"({model_settings.llm_timeout_s:g}) may let a claim end before its decision is "
        f"written (up to {needed_s:g} s beyond the call); a redelivery would then call the "
        f"model again: set LEASE_MARGIN_S to at least {needed_s - model_settings.llm_timeout_s:g}"
    )


def check_the_holds(settings: ScorerSettings, model_settings: ModelSettings) -> None:
    """Refuse a hold past the consumer timeout; warn of a lease too short."""
    refuse_a_hold_past_the_consumer_timeout(settings, model_settings)
    if warning := lease_warning(settings, model_settings):
        log.warning(warning)


async def _prepare_database(
    attempts: Attempts,
    cancelled_batches: CancelledBatches,
    batch_cancel_records: BatchCancelRecords,
    clock: Callable[[], datetime],
) -> None:
    """The indexes, then the batches cancelled in the last `KEEP_S`: before the broker
    starts, as an item of a batch cancelled while this replica was away, delivered first,
    would be claimed and scored."""
    await attempts.ensure_indexes()
    await batch_cancel_records.ensure_indexes()
    await recall_cancelled_batches(cancelled_batches, batch_cancel_records, now=clock())


def _before_the_work(
    broker: ScoreboxBroker,
    settings: ScorerSettings,
    batches: CancelledBatches,
    records: BatchCancelRecords,
    clock: Callable[[], datetime],
) -> Callable[[], Awaitable[None]]:
    """What `score.requested`'s consumer awaits before it starts, the scorer's other
    consumers started: the batch cancellations stored are read again (this replica's own
    queue is bound now: one announced before reached only the others, which stored it), and
    the cancels queued are handled (`cancels_handled_first`), within half the start's time."""
    within_s = min(CANCELS_FIRST_S, settings.startup_timeout_s / 2)

    async def before_the_work() -> None:
        await recall_again(batches, records, now=clock())
        await cancels_handled_first(broker, within_s=within_s, timeout_s=settings.broker_timeout_s)

    return before_the_work


def create_app(
    settings: ScorerSettings,
    model_settings: ModelSettings,
    *,
    broker: ScoreboxBroker | None = None,
    mongo: MongoClient | None = None,
    model: ScoreModel | None = None,
    clock: Callable[[], datetime] | None = None,
    rng: random.Random | None = None,
) -> FastAPI:
    """Wire the scorer: broker (prefetch: the deliveries in hand) + database + model (at most
    `concurrency` calls at once) + HTTP health."""
    clock = clock or DatabaseClock()  # the time its records are judged by
    check_the_holds(settings, model_settings)
    grace_s = stop_grace_s(settings, model_settings)
    broker = broker or make_broker(
        settings, prefetch=settings.deliveries_in_hand, name="scorer", graceful_timeout_s=grace_s
    )
    mongo = mongo or make_mongo(settings)
    http: ProviderClient | None = None
    if model is None:
        if model_settings.llm_provider == "openai":
            http = make_http_client(model_settings, concurrency=settings.concurrency)
        model = build_model(model_settings, http)
    attempts = Attempts(
        mongo,
        settings.database_name("scorer"),
        retention=timedelta(seconds=settings.attempts_retention_s),
    )

    jitter = rng or random.Random()  # noqa: S311 - jitter, not cryptography
    metrics = ScorerMetrics(broker.metrics.registry)
    replica = f"{socket.gethostname()}:{os.getpid()}:{new_id()[:8]}"
    provider = provider_of(model_settings)

    pauses = PauseAnnouncer(
        clock=clock,
        publish=partial(publish_ops_event, broker, timeout=settings.broker_timeout_s),
        replica=replica,
        provider=provider,
        timeout_s=settings.broker_timeout_s,
    )

    def pause_begun(pause_s: float, outage: bool) -> None:
        metrics.rate_limit_pauses.inc()
        pauses.announce(pause_s, outage)

    cancelled_batches = CancelledBatches(clock=clock)
    batch_cancel_records = BatchCancelRecords(mongo, settings.database_name("scorer"))
    deps = ScorerDeps(
        attempts=attempts,
        model=model,
        announce=partial(publish_event, broker, timeout=settings.broker_timeout_s),
        clock=clock,
        lease=timedelta(seconds=lease_s(settings, model_settings)),
        retry_policy=RetryPolicy(
            base_s=settings.retry_base_s,
            cap_s=settings.retry_cap_s,
            rate_limit_retries=settings.rate_limit_retries,
        ),
        rng=jitter,
        owner=replica,
        model_slots=ModelSlots(settings.concurrency),
        throttle=ModelThrottle(
            hold_s=settings.rate_limit_hold_s,
            rng=jitter,
            on_pause=pause_begun,
            check_provider=provider_checks(model, metrics),
            probe_first=True,
        ),
        started_after=timedelta(seconds=settings.started_after_s),
        metrics=metrics,
        cancelled_batches=cancelled_batches,
    )
    deps.metrics.slots_busy.set_function(lambda: deps.model_slots.busy)
    deps.metrics.model_calls_paused.set_function(lambda: float(deps.throttle.paused))
    actions = BrokerActions(
        broker=broker,
        timeout_s=settings.broker_timeout_s,
        clock=clock,
        outcome_batch_max=settings.outcome_batch_max,
    )
    subscribe_scorer(
        broker,
        deps,
        actions,
        crash_limit=settings.crash_limit,
        starts_after=_before_the_work(
            broker, settings, cancelled_batches, batch_cancel_records, clock
        ),
    )
    cancels = TaskCancels(
        attempts, broker, clock, timeout_s=settings.broker_timeout_s, metrics=metrics
    )
    subscribe_cancels(broker, cancels)
    subscribe_shared_pauses(
        broker, deps.throttle, metrics, replica=replica, provider=provider, clock=clock
    )
    subscribe_batch_cancels(
        broker, cancelled_batches, batch_cancel_records, metrics, replica=replica
    )

    clock_watch = clock_watch_of(mongo, settings, broker.metrics, service="scorer", clock=clock)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await prepare_service_database(
            mongo,
            settings,
            lambda: _prepare_database(attempts, cancelled_batches, batch_cancel_records, clock),
            service="scorer",
            clock_watch=clock_watch,
        )
        await start_broker(broker, settings)
        clock_watch.start()
        yield
        # No model call starts any more: the deliveries waiting for a slot, and any that
        # arrives before the consumer is cancelled, are sent again with their delivery counts
        # (`scoring._turned_away`); one at its delivery limit never waits for another claim
        # (`consumer._handed_back`). Those in a slot finish within the grace period
        # (`stop_grace_s`).
        stopping = asyncio.get_running_loop().time()
        deps.model_slots.close()
        await broker.stop_consuming()
        # Decisions whose delivery was lost (a broker connection dropped under them) are in no
        # handler: they get what is left of the grace period too.
        left_s = grace_s - (asyncio.get_running_loop().time() - stopping)
        unfinished = await deps.decisions.ended(timeout_s=left_s)
        if unfinished:
            log.warning("stopping with %d decisions still running past the grace", unfinished)
        await pauses.close()
        await broker.stop(begun_at=stopping)
        await clock_watch.stop()
        if http is not None:
            await http.aclose()
        await mongo.close()

    return internal_service_app(
        "Scorebox scorer",
        service="scorer",
        settings=settings,
        broker=broker,
        mongo=mongo,
        lifespan=lifespan,
    )
