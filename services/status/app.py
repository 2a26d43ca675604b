"""Composition root of the status service: the task projection and its reads."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from datetime import datetime, timedelta

from bson.errors import InvalidDocument
from fastapi import APIRouter, FastAPI, Query
from pydantic import SecretStr, ValidationError
from pymongo.errors import PyMongoError

from services.status.projection import (
    Tasks,
    apply_projected,
    ensure_indexes,
    find_batch,
    find_history,
    find_task,
    projected_event,
    tasks_collection,
)
from services.status.settings import StatusSettings
from shared.away_gate import AwayGate
from shared.bus import error_words
from shared.clock_offset import DatabaseClock
from shared.coalescing import server_watch
from shared.consumers import Delivery, Handler, ScoreboxBroker, consume
from shared.contracts import (
    MAX_INT64,
    MAX_SEQUENCE,
    BatchProgress,
    TaskHistory,
    TaskView,
)
from shared.failed_deliveries import return_failed
from shared.group_writes import GroupWriter
from shared.http import (
    INTERNAL_PROBLEMS,
    TASK_UNKNOWN,
    Problem,
    database_unavailable,
    internal_guard,
    quoted,
    warn_if_internal_routes_open,
)
from shared.runtime import (
    LETTER_DEADLINE_S,
    MongoClient,
    clock_watch_of,
    keep_dead_lettering,
    keep_trying_database,
    make_broker,
    make_mongo,
    prepare_service_database,
    start_broker,
)
from shared.service_app import internal_service_app
from shared.topology import STATUS_PROJECTION

log = logging.getLogger("scorebox.status")
Clock = Callable[[], datetime]


def create_app(
    settings: StatusSettings,
    *,
    broker: ScoreboxBroker | None = None,
    mongo: MongoClient | None = None,
    clock: Clock | None = None,
    away: AwayGate | None = None,
) -> FastAPI:
    """Wire the status service: broker + database + HTTP app, opened and closed in lifespan.
    `away`: the reads' gate (`shared.away_gate`), one over `mongo` unless given."""
    clock = clock or DatabaseClock()  # the time its records are judged by
    broker = broker or make_broker(settings, prefetch=settings.projection_prefetch, name="status")
    mongo = mongo or make_mongo(settings)
    tasks = tasks_collection(mongo, settings.database_name("status"))
    subscribe_projection(broker, GroupWriter(tasks), settings, clock=clock)

    clock_watch = clock_watch_of(mongo, settings, broker.metrics, service="status", clock=clock)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        warn_if_internal_routes_open(settings.internal_api_key, "status service")
        await prepare_service_database(
            mongo,
            settings,
            lambda: ensure_indexes(tasks, now=clock()),
            service="status",
            clock_watch=clock_watch,
        )
        await start_broker(broker, settings)
        clock_watch.start()
        yield
        await broker.stop()
        await clock_watch.stop()
        await mongo.close()

    app = internal_service_app(
        "Scorebox status",
        service="status service",
        settings=settings,
        broker=broker,
        mongo=mongo,
        lifespan=lifespan,
    )
    # Reads answer 503 at once while the database is known away.
    away = away or AwayGate(
        known=server_watch(mongo).known, refusal=lambda: database_unavailable("GET")
    )
    app.include_router(task_routes(tasks, clock, internal_key=settings.internal_api_key, away=away))
    return app


# An event that passed validation but cannot be applied: a date whose arithmetic leaves
# `datetime`'s range (year 9999), a naive time compared with aware ones, a value BSON cannot
# encode. Retrying meets the same error, and left unsettled it held its delivery (and a
# batch's) until the broker's consumer timeout: dead-lettered like an unreadable event.
UNAPPLICABLE = (InvalidDocument, OverflowError, TypeError, ValueError)


def subscribe_projection(
    broker: ScoreboxBroker,
    writes: GroupWriter,
    settings: StatusSettings,
    *,
    clock: Clock,
    letter_deadline_s: float = LETTER_DEADLINE_S,
) -> Handler:
    """Consume the projection's events, returning the handler registered. A copy to the DLQ
    is tried for `letter_deadline_s` at most, then the delivery is returned as failed
    (`keep_dead_lettering`). A finished task's expiry counts from `clock` when its outcome
    arrives late (`_fields_of`): the clock its reads and the TTL monitor judge by."""
    finished_ttl = timedelta(seconds=settings.finished_task_ttl_s)

    async def dead_letter(message: Delivery, error: str) -> None:
        """Copy to the DLQ, then ack; returned as failed instead, not acked, when the broker
        refused the copy for `letter_deadline_s`. A part of a batch is copied once its
        siblings are settled, and not when one of them brings the batch back
        (`Delivery.settle_last`): it was copied again at every redelivery."""

        async def copy_then_ack() -> None:
            if await keep_dead_lettering(
                broker,
                STATUS_PROJECTION,
                message,
                error=error,
                timeout=settings.broker_timeout_s,
                letter_deadline_s=letter_deadline_s,
            ):
                await message.ack()

        await message.settle_last(copy_then_ack)

    @consume(broker, STATUS_PROJECTION.queue)
    async def record_task_event(message: Delivery) -> None:
        routing_key = message.routing_key
        try:
            event = projected_event(routing_key, message.body)
        except (KeyError, ValidationError) as error:
            log.warning("dead-lettering an unreadable %r event: %s", routing_key, error)
            await dead_letter(message, f"unreadable event {routing_key!r}: {error}")
            return
        if event is None:
            await message.ack()
            return
        try:
            await keep_trying_database(
                lambda: apply_projected(
                    event,
                    writes=writes,
                    finished_ttl=finished_ttl,
                    history_limit=settings.history_limit,
                    now=clock(),
                ),
                what=f"applying {routing_key} of {event.task_id}",
            )
        except UNAPPLICABLE as error:
            log.warning(
                "dead-lettering a %r event of %s it cannot apply: %r",
                routing_key,
                event.task_id,
                error,
            )
            await dead_letter(message, f"{routing_key!r} cannot be applied: {error_words(error)}")
            return
        except PyMongoError as error:
            # Refused for good (a failed validation, a document over 16 MiB): waited out like an
            # outage, it held its delivery for ever; returned as failed, and dead-lettered with
            # the reason at its queue's delivery limit.
            log.exception(
                "the database refused %s of %s; returned as failed", routing_key, event.task_id
            )
            await return_failed(
                broker,
                STATUS_PROJECTION,
                message,
                error=error,
                timeout=settings.broker_timeout_s,
                letter_deadline_s=letter_deadline_s,
            )
            return
        await message.ack()

    return record_task_event


def task_routes(
    tasks: Tasks, clock: Clock, *, internal_key: SecretStr | None, away: AwayGate
) -> APIRouter:
    """The gateway's reads of the projection, guarded by `INTERNAL_API_KEY` when it is set,
    each through `away`."""
    router = APIRouter(
        prefix="/internal/v1",
        tags=["tasks"],
        dependencies=[internal_guard(internal_key)],
        responses=INTERNAL_PROBLEMS,
    )

    @router.get("/tasks/{task_id}", response_model=TaskView)
    async def read_task(task_id: str, tenant_id: str) -> TaskView:
        view = await away.through(
            lambda: find_task(task_id, tenant_id=tenant_id, tasks=tasks, now=clock())
        )
        if view is None:
            raise Problem(
                404, f"No task {quoted(task_id)} is known (or it has expired).", kind=TASK_UNKNOWN
            )
        return view

    @router.get("/tasks/{task_id}/history", response_model=TaskHistory)
    async def read_task_history(
        task_id: str,
        tenant_id: str,
        after: int = Query(
            default=-1, ge=-1, le=MAX_SEQUENCE, description="Only changes after this sequence."
        ),
    ) -> TaskHistory:
        history = await away.through(
            lambda: find_history(
                task_id, tenant_id=tenant_id, after=after, tasks=tasks, now=clock()
            )
        )
        if history is None:
            raise Problem(
                404, f"No task {quoted(task_id)} is known (or it has expired).", kind=TASK_UNKNOWN
            )
        return history

    @router.get("/batches/{batch_id}", response_model=BatchProgress)
    async def read_batch(
        batch_id: str,
        tenant_id: str,
        after: int = Query(
            default=-1, ge=-1, le=MAX_INT64, description="Only items after this batch_index."
        ),
        limit: int = Query(default=100, ge=1, le=1000),
    ) -> BatchProgress:
        # A batch the projection has not heard of reads as empty, not 404: only the gateway
        # knows which batches exist.
        return await away.through(
            lambda: find_batch(
                batch_id, tenant_id=tenant_id, after=after, limit=limit, tasks=tasks, now=clock()
            )
        )

    return router
