"""Runtime glue every service uses: broker and database clients, start-up, HTTP serving.

Nothing here runs at import time; each service's composition root calls these.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import logging
import math
import random
import re
import socket
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any, Final, override
from urllib.parse import urlsplit

import pymongo
import uvicorn
from faststream.rabbit import RabbitBroker
from faststream.rabbit.schemas import Channel
from pymongo import AsyncMongoClient
from pymongo.errors import PyMongoError
from pythonjsonlogger.core import RESERVED_ATTRS
from pythonjsonlogger.json import JsonFormatter
from uvicorn.config import LOGGING_CONFIG

from shared.backoff import capped_exponential_s, jittered_s
from shared.bus import BROKER_ERRORS, publish_dead_letter
from shared.clock_offset import ClockWatch, check_clock
from shared.consumers import Delivery, ScoreboxBroker
from shared.database_errors import transient_database_error
from shared.log_context import (
    KNOWN_LIBRARY_NOISE,
    NOISY_LIBRARY_LOGGERS,
    RECONNECTING_LOGGERS,
    CorrelationFilter,
    RepeatedReconnectAttempts,
)
from shared.metrics import Metrics
from shared.settings import ServiceSettings, StartupRefused, redact_url
from shared.topology import TopologyProbesUnreachable, WorkQueue, declare_topology

if TYPE_CHECKING:
    from fastapi import FastAPI

log = logging.getLogger("scorebox.runtime")

Check = Callable[[], Awaitable[bool]]
MongoClient = AsyncMongoClient[dict[str, Any]]
# Tracked objects allocated (net of those freed) before the youngest generation is
# collected; CPython's default is 2,000 (docs/architecture.md, "The collector").
GC_YOUNG_THRESHOLD = 20_000


# Libraries that log every request at INFO: the gateway's reads of the status service were a
# line each (found in a walkthrough). Kept at WARNING unless the service logs at DEBUG.
CHATTY_LOGGERS = ("httpx",)


def configure_logging(settings: ServiceSettings, service: str) -> None:
    logging.captureWarnings(True)  # Python's warnings as records: JSON lines in json mode
    for name in NOISY_LIBRARY_LOGGERS:
        logging.getLogger(name).addFilter(KNOWN_LIBRARY_NOISE)
    for name in RECONNECTING_LOGGERS:
        _filter_once(logging.getLogger(name), RepeatedReconnectAttempts)
    if settings.log_level.upper() != "DEBUG":
        for name in CHATTY_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)
    if settings.log_format == "json":
        handler = logging.StreamHandler()
        handler.setFormatter(json_log_formatter(service))
        handler.addFilter(CorrelationFilter())
        logging.basicConfig(level=settings.log_level, handlers=[handler])
        return
    logging.basicConfig(
        level=settings.log_level,
        format=f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s",
    )


def _filter_once(logger: logging.Logger, kind: type[logging.Filter]) -> None:
    """Add a `kind` filter to `logger` unless it has one (services built side by side in
    one process, as the tests build them, configure logging each)."""
    if not any(isinstance(existing, kind) for existing in logger.filters):
        logger.addFilter(kind())


def json_log_formatter(service: str) -> logging.Formatter:
    """One JSON object per record: `time` (ISO 8601, UTC), `level`, `logger`, `message`,
    `service`, any `extra` fields (`correlation_id` while a delivery is handled:
    `shared.log_context`), and `exc_info` with the traceback of an exception."""
    return _ServiceJsonFormatter(
        "{levelname}{name}{message}",
        style="{",
        rename_fields={"levelname": "level", "name": "logger"},
        static_fields={"service": service},
        timestamp="time",
        # uvicorn's copy of its message with terminal colour codes in it.
        reserved_attrs=[*RESERVED_ATTRS, "color_message"],
    )


class _ServiceJsonFormatter(JsonFormatter):
    """Strict JSON whatever the extras hold: a non-finite float (`NaN`, which strict
    parsers refuse) is written as a string, and an extra named like a standard field is
    kept under `extra_<name>` instead of replacing it."""

    @override
    def add_fields(
        self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]
    ) -> None:
        super().add_fields(log_data, record, message_dict)
        standard = {"level": record.levelname, "logger": record.name, **self.static_fields}
        for field, value in standard.items():
            if field in record.__dict__:
                log_data[f"extra_{field}"] = record.__dict__[field]
            log_data[field] = value

    @override
    def process_log_record(self, log_data: dict[str, Any]) -> dict[str, Any]:
        return {key: _finite(value) for key, value in log_data.items()}


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {key: _finite(each) for key, each in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(each) for each in value]
    return value


def make_broker(
    settings: ServiceSettings,
    *,
    prefetch: int | None = None,
    name: str = "scorebox",
    graceful_timeout_s: float | None = None,
) -> ScoreboxBroker:
    """A FastStream broker: confirms on, unroutable publishes raise; its consumers on a
    connection of their own (named `name` for the broker's connection list), with `prefetch`
    unless they ask for another. At stop, deliveries in hand get `graceful_timeout_s` to
    finish (`BROKER_TIMEOUT_S` unless given)."""
    return ScoreboxBroker(
        settings.rabbitmq_url,
        timeout=settings.broker_timeout_s,
        prefetch=prefetch,
        name=name,
        client_properties={"name": f"{name} publishers"},
        reconnect_interval=1.0,
        # Publishing only: the consumers' channels carry the prefetch.
        default_channel=Channel(publisher_confirms=True, on_return_raises=True),
        graceful_timeout=graceful_timeout_s or settings.broker_timeout_s,
        logger=logging.getLogger("scorebox.broker"),
        log_level=logging.DEBUG,
        apply_types=False,
    )


# Every consumer acknowledges its delivery once its write is acknowledged, and the gateway
# answers 202 once its submission is: a write acknowledged before its journal commit (a
# standalone server's default, `w: 1`, commits every 100 ms) or by the primary alone (lost
# in a failover's rollback) was gone for good with the message already settled (review of
# the status projection). `MONGO_URL`'s own `w` or `journal` is used as given.
DURABLE_WRITES: Final[Mapping[str, Any]] = {"w": "majority", "journal": True}


# A URL setting any of these has chosen its write concern: none of `DURABLE_WRITES` is added
# (`journal` beside `w=0` or `fsync`, say, PyMongo refuses).
WRITE_CONCERN_OPTIONS: Final = frozenset({"w", "journal", "fsync", "wtimeoutms"})


def durable_write_options(mongo_url: str) -> dict[str, Any]:
    """`DURABLE_WRITES`, unless `mongo_url` sets a write concern option itself (names are
    case-insensitive in a MongoDB URL, and options may be separated by `;` as by `&`)."""
    query = urlsplit(mongo_url).query
    given = {option.split("=", 1)[0].strip().lower() for option in re.split("[&;]", query)}
    return {} if given & WRITE_CONCERN_OPTIONS else dict(DURABLE_WRITES)


def make_mongo(settings: ServiceSettings, **options: Any) -> MongoClient:
    """An async PyMongo client whose every operation is bounded by `MONGO_TIMEOUT_S`, and
    whose writes are acknowledged once durable (`DURABLE_WRITES`).

    `timeoutMS` (client-side operation timeout) bounds an operation as a whole: server
    selection, a new connection, the driver's own retry and the reply. The socket and connect
    timeouts alone bound each step, so one operation on a stalled server could take several
    of them (a timed-out reply, then a reconnect whose handshake times out too). Group
    commit (`shared.coalescing`) counts a write's wait in its queue against the same deadline.
    """
    timeout_ms = int(settings.mongo_timeout_s * 1000)
    return AsyncMongoClient(
        settings.mongo_url,
        timeoutMS=timeout_ms,
        serverSelectionTimeoutMS=timeout_ms,
        connectTimeoutMS=timeout_ms,
        socketTimeoutMS=timeout_ms,
        tz_aware=True,
        uuidRepresentation="standard",
        **durable_write_options(settings.mongo_url),
        **options,  # more client options (`event_listeners`, for one)
    )


class DependencyUnreachable(TimeoutError):
    """A dependency (RabbitMQ, MongoDB) did not answer within `STARTUP_TIMEOUT_S`."""


def _given_up(message: str) -> DependencyUnreachable:
    """The start-up's giving up, logged first as one line for the operator (uvicorn's
    traceback follows it)."""
    log.error("%s", message)
    return DependencyUnreachable(message)


async def retry_until(
    action: Callable[[], Awaitable[Any]], *, what: str, deadline_s: float
) -> None:
    """Run `action` until it succeeds or `deadline_s` passes (start-up only; any error means
    "not yet", backed off by `keep_trying`); then `DependencyUnreachable` naming `what` and
    its last error. A start whose deadline cut its first attempt short (`STARTUP_TIMEOUT_S`
    under `MONGO_TIMEOUT_S`) logged nothing, and ended on a bare `TimeoutError` naming no
    dependency (a walkthrough)."""
    failures: list[Exception] = []

    async def attempt() -> None:
        try:
            await action()
        except Exception as error:
            failures.append(error)
            raise

    try:
        async with asyncio.timeout(deadline_s):
            # No `give_up_after_s`: it gives up before a wait that would pass it, up to
            # 5 s short of the deadline this message names (a re-read).
            await keep_trying(attempt, what=f"reaching {what}", retry_on=(Exception,))
    except TimeoutError:
        last = failures[-1] if failures else None
        why = f"its last error: {last!r}" if last else "its first attempt had no answer yet"
        raise _given_up(
            f"{what} not reachable within STARTUP_TIMEOUT_S ({deadline_s:g} s); {why}"
        ) from None


async def prepare_database(action: Callable[[], Awaitable[Any]], *, deadline_s: float) -> None:
    """Run a service's start-up database work (indexes, migrations) until it succeeds or
    `deadline_s` passes, without the per-operation deadline of `make_mongo`.

    That deadline reaches the server as `maxTimeMS`, and MongoDB aborts an index build whose
    `createIndexes` is interrupted: a new index on a collection too large to build within
    `MONGO_TIMEOUT_S` would be started and aborted at every start-up, and never exist. Here
    each step keeps only the socket and server-selection timeouts, as before `timeoutMS`:
    the build goes on on the server while the start-up retries (and then finds it).
    """
    with pymongo.timeout(0):  # 0: no deadline, so no `maxTimeMS`
        await retry_until(action, what="MongoDB", deadline_s=deadline_s)


async def prepare_service_database(
    mongo: MongoClient,
    settings: ServiceSettings,
    action: Callable[[], Awaitable[Any]],
    *,
    service: str,
    clock_watch: ClockWatch,
) -> None:
    """A service's start-up with its database: `action` run as `prepare_database` runs it,
    then its clock checked against the database server's (`shared/clock_offset.py`), the
    measure handed to the service's `clock_watch`, which it starts once up."""
    await prepare_database(action, deadline_s=settings.startup_timeout_s)
    max_offset_s = settings.max_clock_offset_s
    clock_watch.checked(
        await check_clock(
            mongo, max_offset_s=max_offset_s, service=service, ticks=clock_watch.ticks
        )
    )


def clock_watch_of(
    mongo: MongoClient,
    settings: ServiceSettings,
    metrics: Metrics,
    *,
    service: str,
    clock: Callable[[], datetime],
) -> ClockWatch:
    """The service's clock watch, built with it (its gauge registered once per app); it
    anchors the service's `clock` at each measure when that is a `DatabaseClock`."""
    return ClockWatch(
        mongo,
        max_offset_s=settings.max_clock_offset_s,
        service=service,
        registry=metrics.registry,
        keeping=clock,
    )


# The jitter of `keep_trying`'s waits (not cryptography).
_JITTER = random.Random()  # noqa: S311


async def keep_trying[T](
    action: Callable[[], Awaitable[T]],
    *,
    what: str,
    retry_on: tuple[type[BaseException], ...],
    retry_if: Callable[[BaseException], bool] | None = None,
    first_delay_s: float = 0.2,
    max_delay_s: float = 5.0,
    give_up_after_s: float | None = None,
) -> T:
    """Repeat an idempotent write until the database takes it, backing off.

    `retry_if`: of the errors of `retry_on`, those to wait out (all when None); any other is
    raised at once, for the caller to count (`shared.database_errors.transient_database_error`
    tells a database that is away from a write it refuses for good).

    For consumers: the message stays unacknowledged meanwhile (back-pressure through the
    prefetch), and is neither nacked with requeue (RabbitMQ 4.3 and later do not count that,
    earlier versions count it towards the delivery limit) nor lost. Cancellation (shutdown,
    a lost broker connection) stops it; the broker then redelivers the message. With
    `give_up_after_s`, the last error is raised instead of a wait that would end past that
    many seconds.
    """
    loop = asyncio.get_running_loop()
    deadline = None if give_up_after_s is None else loop.time() + give_up_after_s
    for attempt in itertools.count(1):
        try:
            return await action()
        except retry_on as error:
            if retry_if is not None and not retry_if(error):
                raise
            # Jittered: writes that failed together (one grouped round trip) retry apart.
            delay = capped_exponential_s(attempt, base_s=first_delay_s, cap_s=max_delay_s)
            wait = jittered_s(delay, _JITTER)
            if deadline is not None and loop.time() + wait > deadline:
                raise
            log.warning("%s failed (%r); retrying in %.1fs", what, error, wait)
            await asyncio.sleep(wait)
    raise AssertionError("unreachable: the attempts never run out")


# How often a held redelivery (one kept unacknowledged while another claim on its work lasts)
# looks again whether that claim was decided or freed.
HOLD_POLL_S = 2.0


async def wait_for_claim(until: datetime, clock: Callable[[], datetime]) -> None:
    """Wait until just after `until`, when a claim's lease ends, or `HOLD_POLL_S` if sooner
    (the claim may be decided or freed before its lease ends)."""
    remaining = (until - clock()).total_seconds()
    await asyncio.sleep(min(max(remaining, 0.0) + 0.05, HOLD_POLL_S))


async def keep_trying_database[T](
    action: Callable[[], Awaitable[T]], *, what: str, give_up_after_s: float | None = None
) -> T:
    """Repeat an idempotent database operation while the database is away or slow
    (`keep_trying` on `PyMongoError`, waiting out only `transient_database_error`s). One it
    refuses for good (a document over 16 MiB, a failed validation) is raised at once:
    waited out, it would hold the delivery for ever."""
    return await keep_trying(
        action,
        what=what,
        retry_on=(PyMongoError,),
        retry_if=transient_database_error,
        give_up_after_s=give_up_after_s,
    )


async def keep_publishing(publish: Callable[[], Awaitable[object]], *, what: str) -> None:
    """Repeat a confirmed publish until the broker confirms it (`keep_trying` on
    `BROKER_ERRORS`: away, blocked by an alarm, a full queue), for a consumer's handler.

    The handler holds its delivery meanwhile and settles it afterwards: a handler that gave
    up would leave the delivery unacknowledged, holding a prefetch slot, until its channel
    closed; one that nacked it with requeue would spin through the delivery limit before
    RabbitMQ 4.3 and without end from 4.3. A repeated publish may arrive twice or more (each
    unconfirmed send may still be delivered), under the same message id: its consumer must
    take the repeats as no-ops (the cron consumer fences them by the run's hold,
    `services.scheduler.firings`).
    """
    await keep_trying(publish, what=f"publishing {what}", retry_on=BROKER_ERRORS)


# How long a handler tries to copy a delivery to its queue's DLQ (`keep_dead_lettering`)
# before it returns the delivery as failed instead.
LETTER_DEADLINE_S = 30.0


async def keep_dead_lettering(
    broker: RabbitBroker,
    work_queue: WorkQueue,
    message: Delivery,
    *,
    error: str,
    timeout: float,
    headers: Mapping[str, Any] | None = None,
    letter_deadline_s: float = LETTER_DEADLINE_S,
) -> bool:
    """Copy a delivery to its queue's DLQ with `error` (`publish_dead_letter`), trying again
    while the broker does not confirm it (`keep_trying` on `BROKER_ERRORS`), for
    `letter_deadline_s` at most; `headers` replace the delivery's own.

    True once the broker confirmed the copy: the caller settles the delivery (acks it).
    False when the broker refused it that long (a memory alarm, the DLQ deleted): the
    delivery has been returned as failed (`Delivery.requeue_failed`), for the queue's
    delivery limit to have RabbitMQ dead-letter it without the reason; it is settled, and
    the caller must not ack it. Tried without a deadline, the handler held the delivery, and
    its prefetch slot, for as long as the broker refused: a consumer whose prefetch filled
    with such deliveries handled nothing more.
    """
    try:
        await keep_trying(
            lambda: publish_dead_letter(
                broker,
                work_queue,
                body=message.body,
                headers=dict(message.headers) if headers is None else headers,
                error=error,
                timeout=timeout,
                message_id=message.message_id,
                correlation_id=message.correlation_id,
                routing_key=message.routing_key,
            ),
            what=f"publishing a dead letter of {work_queue.name}",
            retry_on=BROKER_ERRORS,
            give_up_after_s=letter_deadline_s,
        )
    except BROKER_ERRORS as refused:
        log.warning(
            "%s: the broker did not take the dead letter of %s (%r); returned as failed, for "
            "RabbitMQ to dead-letter without the reason",
            work_queue.name,
            message.message_id,
            refused,
        )
        await message.requeue_failed()
        return False
    return True


async def start_broker(broker: RabbitBroker, settings: ServiceSettings) -> None:
    """Connect (waiting for RabbitMQ if it is still starting), declare topology, consume;
    connecting, declaring and starting the consumers each take at most `STARTUP_TIMEOUT_S`."""
    rabbitmq = f"RabbitMQ at {redact_url(settings.rabbitmq_url)}"
    deadline_s = settings.startup_timeout_s
    await retry_until(broker.connect, what=rabbitmq, deadline_s=deadline_s)
    # The declarations are round trips of their own (some on channels FastStream does not
    # bound): a broker that stops answering must not hold the service's start for ever.
    declaring = f"{rabbitmq} (declaring the topology)"
    async with _named_on_timeout(declaring, deadline_s):
        await _declare_topology_probed(broker, what=declaring, deadline_s=deadline_s)
    # Starting opens the consuming connection and, per consumer, a channel, its prefetch, a
    # declaration and the consume: each bounded by BROKER_TIMEOUT_S, all by this.
    async with _named_on_timeout(f"{rabbitmq} (starting the consumers)", deadline_s):
        await broker.start()


async def _declare_topology_probed(broker: RabbitBroker, *, what: str, deadline_s: float) -> None:
    """`declare_topology`, declared again while the broker refuses its probing connection
    (`TopologyProbesUnreachable`: a connection limit reached while old replicas' connections
    linger in a rolling restart, say), as the first connection is waited for, until
    `deadline_s` (the caller's too); then `DependencyUnreachable` naming `what` and the
    refusal. Refused once, the start ended at once (the re-read); refused to the end, it
    ended on the caller's "answers too slowly" (the next re-read)."""
    try:
        await keep_trying(
            lambda: declare_topology(broker),
            what="declaring the topology",
            retry_on=(TopologyProbesUnreachable,),
            give_up_after_s=deadline_s,
        )
    except TopologyProbesUnreachable as error:
        raise _given_up(f"{what} not done within STARTUP_TIMEOUT_S: {error}") from error


@contextlib.asynccontextmanager
async def _named_on_timeout(what: str, deadline_s: float) -> AsyncIterator[None]:
    """The block within `deadline_s`, else `DependencyUnreachable` naming `what`, logged
    first: a stall there ended the start on a bare `TimeoutError` (a review)."""
    within = asyncio.timeout(deadline_s)
    try:
        async with within:
            yield
    except TimeoutError:
        if not within.expired():
            raise  # a bound of its own inside (`BROKER_TIMEOUT_S`), named by its error
        # "Not answering" sent an operator looking for a dead broker when each of the
        # round trips had its answer, slowly (a walkthrough over a 0.5 s link).
        raise _given_up(
            f"{what} not done within STARTUP_TIMEOUT_S ({deadline_s:g} s): it stopped "
            "answering, or answers too slowly for all its round trips (over a slow link, "
            "raise STARTUP_TIMEOUT_S)"
        ) from None


# The longest a readiness check waits for its dependency (`timeout`, when shorter): `/readyz`
# runs its checks at once, so that a probe (Kubernetes gives one 1 s by default) gets its
# answer, 503 included, before it gives up. Waiting for `BROKER_TIMEOUT_S`, then
# `MONGO_TIMEOUT_S`, it answered 503 after 15 s during an outage: the probes timed out instead,
# and uvicorn held a stop for the abandoned ones (up to `HTTP_DRAIN_S`).
READINESS_DEADLINE_S = 0.8


def broker_ready(broker: RabbitBroker, timeout: float) -> Check:
    """The broker's connections up. FastStream's ping polls for a connection being restored
    until its timeout passes: it is given `READINESS_DEADLINE_S` at most."""
    deadline_s = min(timeout, READINESS_DEADLINE_S)

    async def check() -> bool:
        return await broker.ping(timeout=deadline_s)

    return check


# How long uvicorn waits at stop for the requests still open (an SSE stream) before the
# app's lifespan stops it: a service's whole stop takes up to this plus the lifespan's.
HTTP_DRAIN_S = 15


def mongo_ready(client: MongoClient, timeout: float) -> Check:
    """MongoDB answering a ping within `READINESS_DEADLINE_S` (or `timeout`, when shorter)."""
    deadline_s = min(timeout, READINESS_DEADLINE_S)

    async def check() -> bool:
        try:
            async with asyncio.timeout(deadline_s):
                await client.admin.command("ping")
        except Exception:  # noqa: BLE001 - readiness answers "no" on any failure
            return False
        return True

    return check


StoppingHook = Callable[[], None]


def when_stopping(app: FastAPI, hook: StoppingHook) -> None:
    """Call `hook` as soon as the service is asked to stop, before its HTTP server waits (up
    to `HTTP_DRAIN_S`) for the requests still open: requests waiting for events can answer
    now, instead of being cut off when that wait runs out."""
    stopping_hooks(app).append(hook)


def stopping_hooks(app: FastAPI) -> list[StoppingHook]:
    """The app's hooks, one list for its life: a hook registered after the server took it
    (in the lifespan, say) still runs."""
    hooks: list[StoppingHook] | None = getattr(app.state, "stopping_hooks", None)
    if hooks is None:
        hooks = app.state.stopping_hooks = []
    return hooks


class Server(uvicorn.Server):
    """uvicorn's server, calling `stopping` once it starts to stop (a signal, or
    `should_exit`), before it waits for the open requests to finish."""

    def __init__(self, config: uvicorn.Config, stopping: list[StoppingHook]) -> None:
        super().__init__(config)
        self._stopping = stopping

    @override
    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        for hook in self._stopping:
            try:
                hook()
            except Exception:  # a failing hook must not keep the server from stopping
                log.exception("a stopping hook failed")
        await super().shutdown(sockets)


async def serve(app: FastAPI, settings: ServiceSettings) -> None:
    """Serve an app with uvicorn (uvloop where available) until SIGINT/SIGTERM."""
    await Server(server_config(app, settings), stopping_hooks(app)).serve()


def server_config(app: FastAPI, settings: ServiceSettings) -> uvicorn.Config:
    """uvicorn's configuration of a service: JSON logs leave uvicorn's loggers to the root
    handler; an access line per request only with `ACCESS_LOG`."""
    return uvicorn.Config(
        app,
        host=settings.http_host,
        port=settings.port,
        log_config=LOGGING_CONFIG if settings.log_format == "text" else None,
        log_level=settings.log_level.lower(),
        access_log=settings.access_log,
        lifespan="on",
        timeout_keep_alive=30,
        timeout_graceful_shutdown=HTTP_DRAIN_S,
    )


def run_service(name: str, settings: ServiceSettings, make_app: Callable[[], FastAPI]) -> None:
    """A service's entrypoint: log, build the app (no I/O until its lifespan), serve it. An
    app its configuration leaves unable to run (`StartupRefused`) stops the process with one
    line on stderr and exit status 2."""
    configure_logging(settings, name)

    async def main() -> None:
        try:
            app = make_app()
        except StartupRefused as error:
            print(f"{name}: cannot start: {error}", file=sys.stderr)
            raise SystemExit(2) from None
        settle_heap()
        await serve(app, settings)

    run(main)


def settle_heap() -> None:
    """Keep the cyclic collector off what start-up built, and let it run less often.

    The modules, schemas and app built at start-up (about 100,000 objects) live as long as
    the process, yet every full collection walked them all: a 70-90 ms stall of the event
    loop. Frozen, they are left out of every collection; refcounting still frees them.
    Cyclic garbage is then collected once `GC_YOUNG_THRESHOLD` tracked objects have
    accumulated, which bounds what it can hold to a few MB.
    """
    gc.collect()
    gc.freeze()
    _, middle, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, oldest)


def run(main: Callable[[], Awaitable[None]]) -> None:
    """Run a service's async main on uvloop when installed."""
    try:
        import uvloop  # noqa: PLC0415 - optional accelerator

        runner: Callable[[Awaitable[None]], None] = uvloop.run  # type: ignore[assignment]
    except ImportError:  # pragma: no cover - uvloop is a dependency on Linux
        runner = asyncio.run  # type: ignore[assignment]
    with contextlib.suppress(KeyboardInterrupt):
        runner(main())
