"""The whole RabbitMQ topology, declared in this one place.

    exchange          routing key                        queue (consumer)
    scorebox.tasks    score.requested                  → scorebox.score-requests (scorer)
                      score.resubmitted                → scorebox.score-requests (scorer)
                      score.requested, score.withdrawn → scorebox.status-projection (status)
                      score.rescore                    → scorebox.rescore-requests (gateway)
                      score.cancel                     → scorebox.task-cancels (scorer)
                      webhook.deliver                  → scorebox.webhook-deliveries (notifier)
                      usage.retry                      → scorebox.usage-meter (scheduler)
    scorebox.cron     cron.run                         → scorebox.cron-jobs (scheduler)
    scorebox.events   task.*                           → scorebox.status-projection (status)
                      task.*                           → scorebox.live.<replica> (gateway, push)
                      task.completed, task.failed      → scorebox.gateway-task-outcomes (gateway)
                      task.completed, task.failed      → scorebox.usage-meter (scheduler)
                      task.failed                      → scorebox.notifications (notifier)
                      task.completed                   → scorebox.callbacks (exchange)
                      ops.model.paused                 → scorebox.scorer-pauses.<replica> (scorer)
                      batch.cancelling                 → scorebox.batch-cancels.<replica> (scorer)
    scorebox.callbacks x-scorebox-callback: yes        → scorebox.notifications (notifier)
                      ops.#                            → scorebox.ops-log (operators, recent only)
    scorebox.delay    <tier>.#                         → scorebox.wait.<tier> (TTL, then ↓)
                      rescores.#                       → scorebox.wait.rescores (TTL, then ↓)
    scorebox.due      *.<key of a delayed target>      → that target's queue
    scorebox.dlx      <queue>.dlq                      → <queue>.dlq (operators)

Every work queue is a quorum queue with a delivery limit (poison-message guard, explicit so
RabbitMQ 3.x and 4.x behave alike), dead-lettering `at-least-once` to its own DLQ (which
needs `x-overflow: reject-publish`; a full queue then refuses publishes, which publishers
see as a negative confirm: back-pressure, not silent loss).

Delays use no plugin: a ladder of wait queues with fixed TTLs. A message waits in the
largest tier not longer than its remaining delay and dead-letters into `scorebox.due`
keeping its routing key `<tier>.<target key>`, which the target queue is bound to. A
consumer that receives a message not yet due sends it down the ladder again.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import (
    AsyncIterator,
    Awaitable,
    Callable,
    Collection,
    Iterable,
    Mapping,
)
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final, cast

import aiormq
from faststream.rabbit import Channel, ExchangeType, QueueType, RabbitExchange, RabbitQueue

from shared.settings import redact_url
from shared.side_by_side import side_by_side

if TYPE_CHECKING:
    from aio_pika import RobustExchange
    from aio_pika.abc import AbstractQueue
    from faststream.rabbit import RabbitBroker
    from faststream.rabbit.helpers.declarer import RabbitDeclarer

log = logging.getLogger("scorebox.topology")

TASKS = RabbitExchange("scorebox.tasks", type=ExchangeType.DIRECT, durable=True)
EVENTS = RabbitExchange("scorebox.events", type=ExchangeType.TOPIC, durable=True)
DELAY = RabbitExchange("scorebox.delay", type=ExchangeType.TOPIC, durable=True)
DUE = RabbitExchange("scorebox.due", type=ExchangeType.TOPIC, durable=True)
DLX = RabbitExchange("scorebox.dlx", type=ExchangeType.DIRECT, durable=True)
# Cron runs have an exchange of their own, so a cron message never shares a routing table with
# task commands; like every delayed target, `scorebox.cron-jobs` is also bound to `scorebox.due`.
CRON = RabbitExchange("scorebox.cron", type=ExchangeType.DIRECT, durable=True)
# Completions with a callback, picked out by a header (see the notifier's section below).
CALLBACKS = RabbitExchange("scorebox.callbacks", type=ExchangeType.HEADERS, durable=True)
EXCHANGES: tuple[RabbitExchange, ...] = (TASKS, EVENTS, DELAY, DUE, DLX, CRON, CALLBACKS)

DEFAULT_DELIVERY_LIMIT = 5
# A DLQ's own delivery limit, out of any operator's reach. Looking at a dead letter returns it
# to its queue, and RabbitMQ 4.0 to 4.2 count every return against a quorum queue's limit
# (default 20); a DLQ dead-letters nowhere, so at the limit the dead letter would be dropped.
DLQ_DELIVERY_LIMIT: Final = 1_000_000
SCORE_QUEUE_MAX_LENGTH = 500_000

# (tier name, seconds): ordered from shortest to longest.
WAIT_TIERS: tuple[tuple[str, int], ...] = (
    ("1s", 1),
    ("5s", 5),
    ("30s", 30),
    ("2m", 120),
    ("10m", 600),
    ("1h", 3600),
)
# A wait queue apart from the ladder, never chosen for a delay, where re-score requests spend
# 10 minutes: those of tasks the result cache answered, sent after the others, and the
# gateway's retries of re-scores it could not send, at their 10-minute steps. The re-score
# fan-out counts its depth alone against its backlog bound, as requests that each come back
# as one. Counted as the ladder's `10m` tier, with its other delayed work, webhook retries
# of a receiver down for long or submissions scheduled far ahead held the fan-out back (the
# second re-read of the cache's re-scores).
RESCORES_WAIT_TIER: Final = ("rescores", 600)
RESCORES_WAIT: Final = f"scorebox.wait.{RESCORES_WAIT_TIER[0]}"
# Every wait queue declared: the ladder's tiers and the one apart.
WAIT_QUEUE_TIERS: Final = (*WAIT_TIERS, RESCORES_WAIT_TIER)

# The header that names the last error of a message we dead-letter ourselves
# (RabbitMQ adds `x-death` on its own dead-lettering, but knows no reason beyond "rejected").
ERROR_HEADER = "x-scorebox-error"
# A letter of a letter (one moved back to its queue and dead-lettered again): the first
# letter's reason, kept when `ERROR_HEADER` takes the new one.
FIRST_ERROR_HEADER = "x-scorebox-first-error"
# The routing key a message was published with, which a letter keeps: moved back to its queue
# (through the default exchange, under the queue's name) it is read as that message again.
ROUTING_KEY_HEADER = "x-scorebox-routing-key"
ATTEMPTS_HEADER = "x-scorebox-attempts"
# The routing key a task event had before it was sent on under another one (the usage meter's
# retries): tells its contract.
EVENT_KEY_HEADER = "x-scorebox-event"
DEAD_LETTERED_FROM_HEADER = "x-scorebox-queue"
# Set by quorum queues on every redelivery: the deliveries returned unsettled before this one.
DELIVERY_COUNT_HEADER = "x-delivery-count"
# The deliveries returned unsettled on the earlier copies of a message that a consumer acked
# and sent again (a database error on a redelivery): a fresh copy's `x-delivery-count` starts
# at zero, and a message that kills its consumers would loop for ever were a copy to forget
# them. A consumer checks its queue's delivery limit on this and the copy's own count.
EARLIER_DELIVERIES_HEADER = "x-scorebox-earlier-deliveries"

# RabbitMQ's record of a message's dead-letterings, latest first: one table per (queue,
# reason), with its `count`, `time`, `exchange` and `routing-keys`.
X_DEATH_HEADER = "x-death"


def x_deaths(headers: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    """The entries of a message's `x-death`, latest first; none when it has none, and only
    the well-formed ones (tables) of one a publisher set by hand."""
    deaths = headers.get(X_DEATH_HEADER)
    if not isinstance(deaths, list | tuple):
        return []
    return [death for death in deaths if isinstance(death, Mapping)]


def counted_headers(headers: dict[str, Any], *, redelivered: bool) -> dict[str, Any]:
    """A delivery's headers as its consumer reads them: the broker's `x-delivery-count` only
    on a redelivery. On a first delivery the count came with the message from whoever
    published it: a letter moved back by a shovel or the management UI carries its DLQ's
    count (RabbitMQ 4.0-4.2's at-least-once dead-lettering writes the source queue's
    failures into the letter, and each look at the DLQ adds one), and read as the broker's it
    had a letter taken for one at its queue's limit at its first delivery (session 51's
    review of RabbitMQ 4.x). `EARLIER_DELIVERIES_HEADER`, our own, is kept."""
    if redelivered or DELIVERY_COUNT_HEADER not in headers:
        return headers
    return {name: value for name, value in headers.items() if name != DELIVERY_COUNT_HEADER}


def deliveries_lost(headers: Mapping[str, Any]) -> int:
    """How often consumers died (or lost their connection) holding this message: the broker's
    count of this copy plus the one carried from earlier copies."""
    carried = int(headers.get(EARLIER_DELIVERIES_HEADER, 0))
    return carried + int(headers.get(DELIVERY_COUNT_HEADER, 0))


def carried_deliveries(headers: Mapping[str, Any]) -> dict[str, Any]:
    """The header a copy of this very message (the same attempt, sent again) takes along: the
    deliveries lost so far. Never a next attempt's: it is a new message."""
    deliveries = deliveries_lost(headers)
    return {EARLIER_DELIVERIES_HEADER: deliveries} if deliveries else {}


@dataclass(frozen=True)
class Binding:
    exchange: RabbitExchange
    routing_key: str = ""
    arguments: Mapping[str, Any] | None = None  # a headers exchange's match


@dataclass(frozen=True)
class WorkQueue:
    """A quorum queue with its bindings and its own dead-letter queue."""

    name: str
    bindings: tuple[Binding, ...]
    delivery_limit: int = DEFAULT_DELIVERY_LIMIT
    max_length: int | None = None
    extra_arguments: dict[str, Any] = field(default_factory=dict)

    @property
    def dead_letter_routing_key(self) -> str:
        return f"{self.name}.dlq"

    @property
    def queue(self) -> RabbitQueue:
        arguments: dict[str, Any] = {
            "x-delivery-limit": self.delivery_limit,
            "x-dead-letter-exchange": DLX.name,
            "x-dead-letter-routing-key": self.dead_letter_routing_key,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
            **self.extra_arguments,
        }
        if self.max_length is not None:
            arguments["x-max-length"] = self.max_length
        return RabbitQueue(self.name, queue_type=QueueType.QUORUM, arguments=arguments)  # type: ignore[call-overload, no-any-return]

    @property
    def dead_letter_queue(self) -> RabbitQueue:
        return RabbitQueue(
            self.dead_letter_routing_key,
            queue_type=QueueType.QUORUM,
            arguments={"x-delivery-limit": DLQ_DELIVERY_LIMIT},
        )


@dataclass(frozen=True)
class RecentLog:
    """A queue that keeps the recent messages of its bindings for a reader that may never come:
    at most `max_length` of them and none older than `max_age_s`, the oldest dropped first.
    Nothing is rejected or dead-lettered from it (no DLX), so its publishers never fail on it."""

    name: str
    bindings: tuple[Binding, ...]
    max_length: int
    max_age_s: int

    @property
    def queue(self) -> RabbitQueue:
        arguments = {
            "x-max-length": self.max_length,
            "x-overflow": "drop-head",
            "x-message-ttl": self.max_age_s * 1000,
        }
        return RabbitQueue(self.name, queue_type=QueueType.QUORUM, arguments=arguments)  # type: ignore[call-overload, no-any-return]


def _command_queue(
    name: str,
    routing_key: str,
    max_length: int | None = None,
    *,
    sent_now_only: tuple[str, ...] = (),
) -> WorkQueue:
    """A queue fed directly by `scorebox.tasks` and, after a delay, by `scorebox.due`; the
    `sent_now_only` keys come through `scorebox.tasks` alone."""
    return WorkQueue(
        name=name,
        bindings=(
            Binding(TASKS, routing_key),
            Binding(DUE, f"*.{routing_key}"),
            *(Binding(TASKS, key) for key in sent_now_only),
        ),
        max_length=max_length,
    )


# A task sent again (re-score, DLQ replay) goes to the scorer only, as `score.resubmitted`: the
# projection holds the task's earlier outcome, which its copy of a command the full score
# queue refused would replace with `queued` for a generation that never runs. The gateway
# announces a resubmission once the broker confirmed it (`task.accepted` of its generation).
SCORE_REQUESTS = _command_queue(
    "scorebox.score-requests",
    "score.requested",
    max_length=SCORE_QUEUE_MAX_LENGTH,
    sent_now_only=("score.resubmitted",),
)
# A client's cancellation of a task (`CancelTask`), for the scorer, which records it as the
# decision of the task's next attempt unless its model call has started. Never delayed.
TASK_CANCELS = WorkQueue(name="scorebox.task-cancels", bindings=(Binding(TASKS, "score.cancel"),))
# The projection takes a copy of every submission sent straight to the scorer: a task sent now is
# known from its command (no `task.accepted` publish of its own); a task that waits on the
# ladder is announced by `task.accepted` (status `scheduled`). The copy arrives even when the
# broker refuses the command because the score queue is full: the gateway then withdraws it.
STATUS_PROJECTION = WorkQueue(
    name="scorebox.status-projection",
    bindings=(
        Binding(EVENTS, "task.*"),
        Binding(TASKS, "score.requested"),
        Binding(TASKS, "score.withdrawn"),
    ),
)


# --- Gateway: task outcomes ------------------------------------------------------------------
# The gateway's copy of every task outcome: it releases the task's in-flight slot of its tenant
# (`services/gateway/limits.py`) and, for `task.completed`, notes the task's generation and
# fills the result cache (event-carried state). One queue for all three: each outcome costs
# the broker and the gateway one delivery, not one per purpose.
GATEWAY_TASK_OUTCOMES = WorkQueue(
    name="scorebox.gateway-task-outcomes",
    bindings=(Binding(EVENTS, "task.completed"), Binding(EVENTS, "task.failed")),
)
# Queues of earlier versions, deleted by `declare_topology`: nothing consumes them any more,
# and a quorum queue without a consumer or a length limit would grow without end.
RETIRED_QUEUES = (
    "scorebox.result-cache",
    "scorebox.result-cache.dlq",
    "scorebox.ops-events",  # replaced by `scorebox.ops-log` (see OPS_LOG)
    "scorebox.ops-events.dlq",
)


# --- Scheduler -------------------------------------------------------------------------------
CRON_JOBS = WorkQueue(
    name="scorebox.cron-jobs",
    bindings=(Binding(CRON, "cron.run"), Binding(DUE, "*.cron.run")),
)
# The scheduler's copy of `task.completed` (usage records, catalogue of completed tasks). A
# record it could not store comes back through the wait ladder as `usage.retry`.
USAGE_RETRY_ROUTING_KEY = "usage.retry"
USAGE_METER = WorkQueue(
    name="scorebox.usage-meter",
    bindings=(
        Binding(EVENTS, "task.completed"),
        Binding(EVENTS, "task.failed"),  # an unusable answer's tokens are billed too
        Binding(TASKS, USAGE_RETRY_ROUTING_KEY),
        Binding(DUE, f"*.{USAGE_RETRY_ROUTING_KEY}"),
    ),
)
# Re-score requests from the scheduler's fan-out; the gateway consumes them. Bounded like the
# score queue: when full, the fan-out's publishes are refused (back-pressure) and its run
# waits for room, then resumes from its checkpoint.
RESCORE_REQUESTS = _command_queue(
    "scorebox.rescore-requests", "score.rescore", max_length=SCORE_QUEUE_MAX_LENGTH
)

# Operations events (`ops.housekeeping`, `ops.alert.*`) for an operator or a notifier to read.
# Publishes are mandatory, so these events need a queue bound. Nothing in Scorebox reads it,
# so it keeps a week of them. Its predecessor, `scorebox.ops-events`, refused publishes once
# full: with nobody reading, after about ten weeks (one housekeeping event every ten minutes)
# every housekeeping run failed and the dead-letter alerts stopped.
OPS_LOG = RecentLog(
    name="scorebox.ops-log",
    bindings=(Binding(EVENTS, "ops.#"),),
    max_length=10_000,
    max_age_s=7 * 24 * 3600,
)


# --- Notifier --------------------------------------------------------------------------------
#   scorebox.events (topic)  --task.failed----------------------> scorebox.notifications
#   scorebox.events (topic)  --task.completed-------------------> scorebox.callbacks (headers)
#   scorebox.callbacks       --x-scorebox-callback: yes---------> scorebox.notifications
#   scorebox.tasks  (direct) --webhook.deliver------------------> scorebox.webhook-deliveries
#   scorebox.due    (topic)  --*.webhook.deliver----------------> scorebox.webhook-deliveries
#   scorebox.due    (topic)  --*.task.completed|failed----------> scorebox.notifications
# The notifier turns terminal events into deliveries: an outcome carries its task's callback
# URL. Every failure may owe its tenant a failure alert, so the notifier takes every
# `task.failed`; a completion only matters when it has a callback, so completions reach it
# through `scorebox.callbacks`, which passes on those whose publisher set
# `x-scorebox-callback: yes` (`shared.bus`). A completion without a callback, most of them,
# costs the notifier nothing.
# A delivery that must wait (retry back-off, Retry-After) rides the wait ladder, and so does an
# event the notifier could not record (its database was unavailable).
# Neither queue has a length limit: with `reject-publish`, a full notifications queue would
# refuse the task events themselves and tie every service's progress to the notifier.
# Compatibility with earlier versions:
# - completions of producers before schema version 2 carry no `x-scorebox-callback` (and
#   perhaps no callback URL); the second `scorebox.callbacks` binding lets them all through;
# - those versions bound `task.completed` straight to `scorebox.notifications`; that binding is
#   removed (`RETIRED_BINDINGS`), and `task.accepted`'s is left in place where it exists, for
#   outcomes still in flight from producers that did not carry the URL.
CALLBACK_HEADER = "x-scorebox-callback"
CALLBACK_HEADER_VALUE = "yes"
NOTIFIED_EVENT_KEYS = ("task.completed", "task.failed")
# What the notifier sends itself down the wait ladder (its database away): the events above,
# and `task.accepted` where an earlier version's binding still brings it. Without a binding
# of its own in `scorebox.due`, RabbitMQ dropped such an acceptance when its wait ended, and
# the callback waiting for its URL was never sent (found in review).
RETRIED_EVENT_KEYS = (*NOTIFIED_EVENT_KEYS, "task.accepted")
CALLBACK_EVENT_KEY = "task.completed"
# `all-with-x`: a headers exchange ignores `x-` headers under plain `all` (RabbitMQ >= 3.10).
NOTIFY_WITH_CALLBACK = {"x-match": "all-with-x", CALLBACK_HEADER: CALLBACK_HEADER_VALUE}
_OF_SCHEMA_1 = {"x-match": "all-with-x", "x-schema-version": 1, "x-message-type": "TaskCompleted"}
NOTIFICATIONS = WorkQueue(
    name="scorebox.notifications",
    bindings=(
        Binding(EVENTS, "task.failed"),
        Binding(CALLBACKS, "with-callback", NOTIFY_WITH_CALLBACK),
        Binding(CALLBACKS, "schema-1", _OF_SCHEMA_1),
        *(Binding(DUE, f"*.{key}") for key in RETRIED_EVENT_KEYS),
    ),
)
WEBHOOK_DELIVERIES = _command_queue("scorebox.webhook-deliveries", "webhook.deliver")

WORK_QUEUES: tuple[WorkQueue, ...] = (
    SCORE_REQUESTS,
    TASK_CANCELS,
    STATUS_PROJECTION,
    GATEWAY_TASK_OUTCOMES,
    CRON_JOBS,
    USAGE_METER,
    RESCORE_REQUESTS,
    NOTIFICATIONS,
    WEBHOOK_DELIVERIES,
)

# Bindings of earlier versions, removed by `declare_topology` (queue → (exchange, key)).
RETIRED_BINDINGS: dict[str, tuple[tuple[RabbitExchange, str], ...]] = {
    NOTIFICATIONS.name: ((EVENTS, "task.completed"),),
}


def wait_queue(tier: str, seconds: int) -> RabbitQueue:
    return RabbitQueue(
        f"scorebox.wait.{tier}",
        queue_type=QueueType.QUORUM,
        arguments={
            "x-message-ttl": seconds * 1000,
            "x-dead-letter-exchange": DUE.name,
            "x-dead-letter-strategy": "at-least-once",
            "x-overflow": "reject-publish",
        },
    )


# A tier fits a delay up to this much shorter than the tier: a delay computed as "5 s from
# now" is a hair under 5 s by the time it is published, and took the 1 s tier. Consumers of
# events (which carry no due time to check) then handled it 4 s early.
TIER_SLACK_S = 0.5


def wait_tier_for(delay_s: float) -> tuple[str, int] | None:
    """The wait tier for a remaining delay, or None when the message is due now.

    The largest tier not longer than the delay (give or take `TIER_SLACK_S`), so a message
    never waits past its due time by more than the 1 s tier's granularity; a longer delay hops
    down the ladder.
    """
    if delay_s < 0.5:
        return None
    fitting = [tier for tier in WAIT_TIERS if tier[1] <= max(delay_s + TIER_SLACK_S, 1.0)]
    return fitting[-1]


def delay_routing_key(tier: str, target_routing_key: str) -> str:
    return f"{tier}.{target_routing_key}"


# One channel per chain of declarations that depend on each other, so that the chains run side
# by side: one after another, the topology took about 130 round trips, and a broker 0.5 s
# away did not let a service start within the default `STARTUP_TIMEOUT_S` (a walkthrough).
# Each is a robust channel of the publishing connection, kept open, so that its declarations
# are made again after a reconnection, as the default channel's were.
_DECLARING_CHANNELS: Final = tuple(
    Channel(publisher_confirms=False) for _ in range(len(WORK_QUEUES) + 1 + len(WAIT_QUEUE_TIERS))
)


async def declare_topology(broker: RabbitBroker) -> None:
    """Declare every exchange, queue and binding; idempotent, run by each service at start.

    The exchanges are declared on the broker's own channel, one after another: every
    publish goes through the exchange object the broker keeps from this declaration
    (`shared.bus.send_raw`), on that channel's confirms and returns. Declared on a channel
    of their own, the publishes went out unconfirmed (the re-read of that change).

    The declarations the broker may refuse, by closing the channel that made them (a DLQ of
    an earlier version, a passive declaration of an absent retired queue), are made on a
    connection of their own, one at a time. aiormq frees a channel's number when the broker
    closes it, but drops the `Close-Ok` it owes when its connection's write queue is full;
    the next channel opened under that number closed the whole connection ("second
    'channel.open' seen"; CI, twice). The publishing connection is busy meanwhile: the
    chains' channels are opened first, together (the probing connection beside them), and
    then the chains run side by side.
    """
    exchanges = {exchange.name: await broker.declare_exchange(exchange) for exchange in EXCHANGES}
    await exchanges[CALLBACKS.name].bind(exchanges[EVENTS.name], routing_key=CALLBACK_EVENT_KEY)
    config = broker.config
    publishing = (await exchanges[DLX.name].channel.get_underlay_channel()).connection
    async with contextlib.AsyncExitStack() as stack:
        connecting = stack.enter_async_context(_probing_connection(publishing))
        channels = (config.channel_manager.get_channel(each) for each in _DECLARING_CHANNELS)
        opened = await side_by_side([connecting, *channels])
        probing = cast("aiormq.abc.AbstractConnection", opened[0])
        clean = await _dead_letter_queues_declaring_cleanly(probing)
        await _declare_chains(config.declarer, exchanges, clean=clean, probing=probing)


async def _declare_chains(
    declarer: RabbitDeclarer,
    exchanges: Mapping[str, RobustExchange],
    *,
    clean: Collection[str],
    probing: aiormq.abc.AbstractConnection,
) -> None:
    """Every queue and its bindings, each chain on a declaring channel of its own; the
    retired queues deleted beside them, on the `probing` connection."""
    channels = iter(_DECLARING_CHANNELS)
    work_queues = (
        _declare_work_queue(declarer, work_queue, exchanges, next(channels), clean=clean)
        for work_queue in WORK_QUEUES
    )
    ops_log = _declare_bound(declarer, OPS_LOG.queue, OPS_LOG.bindings, exchanges, next(channels))
    wait_queues = (
        _declare_bound(
            declarer,
            wait_queue(tier, seconds),
            (Binding(DELAY, f"{tier}.#"),),
            exchanges,
            next(channels),
        )
        for tier, seconds in WAIT_QUEUE_TIERS
    )
    retired = _delete_retired_queues(probing)
    await side_by_side([*work_queues, ops_log, *wait_queues, retired])


class TopologyProbesUnreachable(ConnectionError):
    """The connection for the declarations the broker may refuse could not be opened."""


@contextlib.asynccontextmanager
async def _probing_connection(
    publishing: aiormq.abc.AbstractConnection,
) -> AsyncIterator[aiormq.abc.AbstractConnection]:
    """A connection to `publishing`'s broker and vhost, as `publishing` with its TLS context,
    closed after. Bounded by the caller's deadline, as every declaration here is
    (`start_broker`): a fixed bound of its own ended a start on a bare `TimeoutError`, named
    nowhere, before the configured deadline (the re-read)."""
    if not isinstance(publishing, aiormq.Connection):  # its TLS context would be lost
        raise TypeError(f"not an aiormq connection: {type(publishing).__name__}")
    connection = aiormq.Connection(publishing.url, context=publishing.ssl_context)
    try:
        try:
            await connection.connect({"connection_name": "scorebox topology probes"})
        except (OSError, aiormq.exceptions.AMQPError) as error:
            where = redact_url(str(publishing.url))
            raise TopologyProbesUnreachable(
                f"the topology probes' connection to {where} was not opened: {error!r}"
            ) from error
        yield connection
    finally:
        await connection.close()


async def _declare_work_queue(
    declarer: RabbitDeclarer,
    work_queue: WorkQueue,
    exchanges: Mapping[str, RobustExchange],
    channel: Channel,
    *,
    clean: Collection[str],
) -> None:
    """A work queue, its DLQ and their bindings; the bindings of earlier versions removed."""
    dlq = await _declare_dead_letter_queue(
        declarer, work_queue, channel, clean=work_queue.dead_letter_queue.name in clean
    )
    await dlq.bind(exchanges[DLX.name], routing_key=work_queue.dead_letter_routing_key)
    queue = await _declare_bound(
        declarer, work_queue.queue, work_queue.bindings, exchanges, channel
    )
    for exchange, routing_key in RETIRED_BINDINGS.get(work_queue.name, ()):
        await queue.unbind(exchanges[exchange.name], routing_key=routing_key)


async def _declare_bound(
    declarer: RabbitDeclarer,
    queue: RabbitQueue,
    bindings: Iterable[Binding],
    exchanges: Mapping[str, RobustExchange],
    channel: Channel,
) -> AbstractQueue:
    declared = await declarer.declare_queue(queue, channel=channel)
    for binding in bindings:
        await declared.bind(
            exchanges[binding.exchange.name],
            routing_key=binding.routing_key,
            arguments=dict(binding.arguments) if binding.arguments else None,
        )
    return declared


async def _declare_dead_letter_queue(
    declarer: RabbitDeclarer, work_queue: WorkQueue, channel: Channel, *, clean: bool
) -> AbstractQueue:
    """The work queue's DLQ, with its delivery limit when it declares `clean`ly; else an
    earlier version's DLQ, declared without the limit, taken as it is, with a warning naming
    the policy that gives it one."""
    wanted = work_queue.dead_letter_queue
    if clean:
        return await declarer.declare_queue(wanted, channel=channel)
    log.warning(
        "%s was declared without a delivery limit by an earlier version; on RabbitMQ 4.0 to "
        "4.2 a dead letter looked at 20 times is dropped. Give it one with a policy: "
        "rabbitmqctl set_policy dlq-peeks '\\.dlq$' '{\"delivery-limit\": %d}' "
        "--apply-to queues",
        wanted.name,
        DLQ_DELIVERY_LIMIT,
    )
    return await declarer.declare_queue(
        RabbitQueue(wanted.name, queue_type=QueueType.QUORUM, declare=False), channel=channel
    )


async def _dead_letter_queues_declaring_cleanly(
    connection: aiormq.abc.AbstractConnection,
) -> frozenset[str]:
    """The DLQs that can be declared as they are (absent, or present with equal arguments),
    tried one after another on a channel of their own. RabbitMQ refuses to declare an
    existing queue with other arguments, and closes the channel that tried: a DLQ of an
    earlier version (without the delivery limit) is not in the set, and the next one is
    tried on a channel opened anew."""
    clean: set[str] = set()
    channel: aiormq.abc.AbstractChannel | None = None
    try:
        for work_queue in WORK_QUEUES:
            wanted = work_queue.dead_letter_queue
            if channel is None or channel.is_closed:
                channel = await connection.channel()
            try:
                await channel.queue_declare(
                    wanted.name,
                    durable=wanted.durable,
                    exclusive=wanted.exclusive,
                    auto_delete=wanted.auto_delete,
                    arguments=wanted.arguments,
                )
            except aiormq.exceptions.ChannelPreconditionFailed:
                continue  # the broker closed that channel
            clean.add(wanted.name)
    finally:
        if channel is not None and not channel.is_closed:
            await channel.close()
    return frozenset(clean)


async def _delete_retired_queues(connection: aiormq.abc.AbstractConnection) -> None:
    """Delete the queues an earlier version declared, those that are empty and unused.

    A retired queue may still hold messages, dead letters among them (the retired
    `scorebox.result-cache.dlq`): deleted regardless, they were lost on upgrade. One that
    holds any, or that an older replica still consumes from (its unacknowledged messages
    count nowhere else), is left in place with a warning naming it, for an operator to drain
    (or shovel) and delete; the next start-up deletes it once it is empty. Quorum queues
    refuse `queue.delete` with `if-empty` (NOT_IMPLEMENTED, closing the connection), so the
    depth is read first: a message arriving between the read and the deletion is lost, as
    before, but nothing routes to a retired queue any more. One after another: the broker
    closes the channel of each absent one (see `declare_topology`).
    """
    for name in RETIRED_QUEUES:
        found = await _passively_declared(connection, name)
        if found is None:
            continue  # absent: nothing to delete
        if found.message_count or found.consumer_count:
            log.warning(
                "%s is retired but still holds %d message(s) (%d consumer(s)): it is left in "
                "place. Drain it (e.g. shovel its messages to where they belong), then "
                "delete it: rabbitmqctl delete_queue %s",
                name,
                found.message_count or 0,
                found.consumer_count or 0,
                name,
            )
            continue
        await _delete_queue(connection, name)


async def _passively_declared(
    connection: aiormq.abc.AbstractConnection, name: str
) -> aiormq.spec.Queue.DeclareOk | None:
    """Queue `name`'s depth and consumers (None if it is absent), changing nothing."""
    try:
        return await _on_a_channel_of_its_own(
            connection, lambda channel: channel.queue_declare(name, passive=True)
        )
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None


async def _delete_queue(connection: aiormq.abc.AbstractConnection, name: str) -> None:
    await _on_a_channel_of_its_own(connection, lambda channel: channel.queue_delete(name))


async def _on_a_channel_of_its_own[T](
    connection: aiormq.abc.AbstractConnection,
    call: Callable[[aiormq.abc.AbstractChannel], Awaitable[T]],
) -> T:
    """`call` on a new channel, closed after it: the broker answers a passive declaration of
    an absent queue by closing the channel that asked, not the broker's own."""
    channel = await connection.channel()
    try:
        return await call(channel)
    finally:
        if not channel.is_closed:
            await channel.close()


# --- Live push -------------------------------------------------------------------------------
# Every gateway replica receives every task event on a queue of its own, to wake its SSE streams
# and long-polls, while any of them wait: the queue is bound to `scorebox.events` on demand
# (`services/gateway/push.py`), so a replica nobody waits on costs the broker nothing per
# event. Not a `WorkQueue`: it is exclusive and auto-deleted (it lives and dies with
# the replica's connection), classic, bounded (dropping the oldest when the replica lags), and
# without a DLX, because nothing is ever rejected from it and losing a live event costs only
# latency: the status projection (with its history) remains the record that streams re-read.
LIVE_EVENTS_PREFIX = "scorebox.live."
LIVE_EVENTS_BINDING = "task.*"
LIVE_EVENTS_MAX_LENGTH = 10_000


def live_events_queue(replica_id: str) -> RabbitQueue:
    """The exclusive queue of one gateway replica; the replica binds it to `scorebox.events`
    with `LIVE_EVENTS_BINDING` while requests wait for live events."""
    return RabbitQueue(
        f"{LIVE_EVENTS_PREFIX}{replica_id}",
        exclusive=True,
        auto_delete=True,
        routing_key=LIVE_EVENTS_BINDING,
        arguments={"x-max-length": LIVE_EVENTS_MAX_LENGTH, "x-overflow": "drop-head"},
    )


# --- Rate-limit pauses shared by the scorer replicas --------------------------------------------
# A scorer answered 429 by the provider tells the others (`ModelCallsPaused`, an `ops.` event,
# so the ops log keeps it too), and each replica hears it on a queue of its own, bound while it
# runs: exclusive and auto-deleted like the live queues, classic, short (a pause is news only
# while it lasts), without a DLX (consumed with auto-ack, nothing is rejected from it).
SCORER_PAUSES_PREFIX = "scorebox.scorer-pauses."
SCORER_PAUSES_BINDING = Binding(EVENTS, "ops.model.paused")
SCORER_PAUSES_MAX_LENGTH = 100


def scorer_pauses_queue(replica_id: str) -> RabbitQueue:
    """The exclusive queue on which one scorer replica hears the others' rate-limit pauses."""
    return _short_replica_queue(f"{SCORER_PAUSES_PREFIX}{replica_id}", SCORER_PAUSES_MAX_LENGTH)


def _short_replica_queue(name: str, max_length: int) -> RabbitQueue:
    """Exclusive, auto-deleted, classic, the oldest message dropped past `max_length`."""
    return RabbitQueue(
        name,
        exclusive=True,
        auto_delete=True,
        arguments={"x-max-length": max_length, "x-overflow": "drop-head"},
    )


# --- Batch cancellations heard by every scorer replica -----------------------------------------
# The gateway announces a batch's cancellation (`BatchCancelling`) as it sends one
# `CancelTask` per item, and each scorer replica hears it on a queue of its own, bound while it
# runs, as the pauses are: a replica that starts later, or misses it, has the items'
# cancellations, which are what records them.
SCORER_BATCH_CANCELS_PREFIX = "scorebox.batch-cancels."
SCORER_BATCH_CANCELS_BINDING = Binding(EVENTS, "batch.cancelling")
SCORER_BATCH_CANCELS_MAX_LENGTH = 100


def scorer_batch_cancels_queue(replica_id: str) -> RabbitQueue:
    """The exclusive queue on which one scorer replica hears of batches cancelled."""
    return _short_replica_queue(
        f"{SCORER_BATCH_CANCELS_PREFIX}{replica_id}", SCORER_BATCH_CANCELS_MAX_LENGTH
    )
