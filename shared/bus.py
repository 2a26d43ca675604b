"""Putting contracts on the wire: the one place that knows exchanges, keys and properties.

Every publish is persistent, mandatory (an unroutable message raises instead of vanishing)
and awaits the broker's publisher confirm within `timeout`; a negative confirm (for example
a full queue with `reject-publish`) raises as well. Callers decide what a failure means,
and `PublishUnconfirmed` tells them the one failure that may still have reached a queue.
Publishes go through aio-pika on the FastStream broker's own channel (`send_raw`).
"""

from __future__ import annotations

import asyncio
import re
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

import aio_pika
import aiormq

from shared.consumers import ScoreboxBroker
from shared.contracts import (
    BatchCancelling,
    CancelTask,
    Contract,
    OpsEvent,
    ScoreText,
    TaskCompleted,
    TaskEvent,
    TaskFailed,
    utcnow,
)
from shared.topology import (
    CALLBACK_HEADER,
    CALLBACK_HEADER_VALUE,
    DEAD_LETTERED_FROM_HEADER,
    DELAY,
    DELIVERY_COUNT_HEADER,
    DLX,
    ERROR_HEADER,
    EVENTS,
    FIRST_ERROR_HEADER,
    ROUTING_KEY_HEADER,
    TASKS,
    WAIT_TIERS,
    WorkQueue,
    delay_routing_key,
    wait_tier_for,
)

if TYPE_CHECKING:
    from faststream.rabbit import RabbitBroker, RabbitExchange

JSON = "application/json"
# The broker answered that it did not take the message (a nack, an unroutable return), or the
# channel was closed before anything was written: it reached no queue.
NOT_SENT = (aiormq.exceptions.DeliveryError, aiormq.exceptions.ChannelInvalidStateError)


class PublishUnconfirmed(Exception):
    """Written to the broker, but no confirm came: a timeout, the connection lost meanwhile,
    or a connection the broker blocks (a memory or disk alarm: it reads the message once the
    alarm ends). The message may be queued, now or later; retrying may send it twice."""


# What a publish raises while the broker is away, blocked, or refusing (a full queue; also
# an unroutable return, which lasts until the topology is declared again): worth trying
# again later. Anything else is a bug in building the message.
BROKER_ERRORS = (
    PublishUnconfirmed,
    aiormq.exceptions.AMQPError,
    aiormq.exceptions.ChannelInvalidStateError,
    ConnectionError,
    TimeoutError,
)


# An object's default repr in an error's text, `<aio_pika.robust_channel.RobustChannel object
# at 0x7f85...>`: its class name says as much.
_OBJECT_REPR = re.compile(r"<(?:\S*\.)?(\w+) object at 0x[0-9a-fA-F]+>")
# Any other repr naming an address (`<coroutine object f at 0x...>`, `<function f at 0x...>`).
_ADDRESSED_REPR = re.compile(r"<([^<>]*?) at 0x[0-9a-fA-F]+>")
# How much of an error's text `error_words` keeps (a server selection's names the topology).
ERROR_WORDS_CHARS = 300


def error_words(error: BaseException) -> str:
    """`error` as a line an operator or a client reads: its type and text, an object's
    repr in it named by its class (a cron run's 503 told the client
    `ChannelInvalidStateError('<aio_pika.robust_channel.RobustChannel object at 0x7f28...>
    closed')`; a walkthrough)."""
    text = _ADDRESSED_REPR.sub(r"\1", _OBJECT_REPR.sub(r"\1", str(error)))
    if len(text) > ERROR_WORDS_CHARS:
        text = text[:ERROR_WORDS_CHARS] + "…"
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def message_headers(message: Contract, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    headers = {
        "x-tenant-id": message.tenant_id,
        "x-schema-version": message.schema_version,
        "x-message-type": type(message).__name__,
        **(extra or {}),
    }
    if isinstance(message, TaskCompleted | TaskFailed) and message.has_callback:
        headers[CALLBACK_HEADER] = CALLBACK_HEADER_VALUE  # routes it to the notifier
    return headers


async def _publish(
    broker: RabbitBroker,
    message: Contract,
    *,
    exchange: RabbitExchange,
    routing_key: str,
    timeout: float,
    headers: Mapping[str, Any] | None = None,
) -> None:
    await send_raw(
        broker,
        message.model_dump_json().encode(),
        exchange=exchange,
        routing_key=routing_key,
        timeout=timeout,
        message_id=message.message_id,
        correlation_id=message.task_id,
        headers=message_headers(message, headers),
    )


async def send_raw(
    broker: RabbitBroker,
    body: bytes,
    *,
    exchange: RabbitExchange,
    routing_key: str,
    timeout: float,
    message_id: str | None,
    correlation_id: str | None,
    headers: dict[str, Any],
) -> None:
    """Publish on the broker's channel (confirms on, returns raise) straight through
    aio-pika: FastStream's `broker.publish` ends in the same `exchange.publish`, and its layer
    above it costs more CPU per message (`python -m bench.micro` compares the two) for
    nothing these publishes use."""
    target = await broker.declare_exchange(exchange)
    deadline = asyncio.get_running_loop().time() + timeout
    try:
        turn = await _turn_of(broker, message_id, deadline)
    except TimeoutError:
        _count(broker, exchange, "not_sent")  # an earlier publish of its id still out
        raise
    try:
        time_left = turn.time_left()
    except TimeoutError:
        turn.end()
        _count(broker, exchange, "not_sent")
        raise
    outcome = "unconfirmed"
    try:
        await target.publish(
            aio_pika.Message(
                body,
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                content_type=JSON,
                message_id=message_id,
                correlation_id=correlation_id,
                timestamp=utcnow(),
                headers=headers,
            ),
            routing_key=routing_key,
            mandatory=True,
            timeout=time_left,
        )
        outcome = "confirmed"
    except NOT_SENT:
        outcome = "not_sent"
        raise
    except asyncio.CancelledError as error:
        current = asyncio.current_task()
        if current is not None and current.cancelling():
            raise  # this task is being cancelled
        # The connection closed under the publish: aiormq rejects the pending confirms with
        # the reason it closed, a CancelledError when its heartbeat found the link stalled.
        raise PublishUnconfirmed(f"the connection closed: {error!r}") from error
    except Exception as error:
        raise PublishUnconfirmed(repr(error)) from error
    finally:
        turn.end()
        _count(broker, exchange, outcome)


def _count(broker: RabbitBroker, exchange: RabbitExchange, outcome: str) -> None:
    if isinstance(broker, ScoreboxBroker):
        broker.metrics.publishes.labels(exchange.name or "(default)", outcome).inc()


# The least of its deadline a publish that waited for its id's turn goes on with.
MIN_PUBLISH_S = 0.05

# The message ids of each broker's publishes that may still be answered (`_turn_of`).
_IN_FLIGHT: weakref.WeakKeyDictionary[RabbitBroker, dict[str, asyncio.Event]] = (
    weakref.WeakKeyDictionary()
)


@dataclass
class _Turn:
    """A publish's turn with its message id (`_turn_of`)."""

    in_flight: dict[str, asyncio.Event] | None
    message_id: str | None
    deadline: float
    waited: bool = False  # for an earlier publish of its id

    def time_left(self) -> float:
        """What is left of the deadline for the publish; TimeoutError (nothing sent) when
        nothing is, or, after a wait, too little for a publish to be written: aiormq's own
        timeout then ran out before it wrote the frames, and that read as "unconfirmed, may
        be queued" (found in review)."""
        left = self.deadline - asyncio.get_running_loop().time()
        if left <= (MIN_PUBLISH_S if self.waited else 0):
            raise TimeoutError("no time left for the publish")
        return left

    def end(self) -> None:
        """Free the id. A publish given up on unanswered (its timeout) frees it too, though
        its return may yet come and be charged to the next publish of the id: kept for a
        while, the id held every resend after a broker alarm back by as long, and such a
        return needs an unroutable publish, which the declared topology leaves none of."""
        if self.in_flight is None or self.message_id is None:
            return
        ours = self.in_flight.pop(self.message_id)
        ours.set()


async def _turn_of(broker: RabbitBroker, message_id: str | None, deadline: float) -> _Turn:
    """One publish of a message id in flight at a time on `broker`: aiormq matches a
    `basic.return` to its publish by message id, so of two in flight together, the first's
    return was charged to the second, and the first's `basic.ack` then confirmed it, an
    unroutable publish taken as confirmed (found in review). Such pairs are rare: two copies
    of one message handled at once, the outbox sweep sending again a command whose first
    publish awaits its confirm, a re-score fan-out overlapping itself. The wait for the
    earlier one counts towards the publish's `deadline` (the event loop's clock); past it,
    TimeoutError, nothing sent."""
    if message_id is None:  # aiormq gives it a random one
        return _Turn(None, None, deadline)
    in_flight = _IN_FLIGHT.setdefault(broker, {})
    waited = message_id in in_flight
    if waited:  # rare: the timeout's context costs about as much as the rest together
        async with asyncio.timeout_at(deadline):
            while (earlier := in_flight.get(message_id)) is not None:
                await earlier.wait()
    in_flight[message_id] = asyncio.Event()
    return _Turn(in_flight, message_id, deadline, waited)


async def publish_event(broker: RabbitBroker, event: TaskEvent, *, timeout: float) -> None:
    await _publish(broker, event, exchange=EVENTS, routing_key=event.routing_key, timeout=timeout)


async def publish_ops_event(broker: RabbitBroker, event: OpsEvent, *, timeout: float) -> None:
    """An operations event (routing key `ops.…`) on `scorebox.events`, now."""
    await _publish(broker, event, exchange=EVENTS, routing_key=event.routing_key, timeout=timeout)


async def publish_batch_cancelling(
    broker: RabbitBroker, event: BatchCancelling, *, timeout: float
) -> None:
    """A batch's cancellation announced to every scorer replica on `scorebox.events`, now."""
    await _publish(broker, event, exchange=EVENTS, routing_key=event.routing_key, timeout=timeout)


async def publish_events(
    broker: RabbitBroker, events: Iterable[TaskEvent], *, timeout: float
) -> None:
    """Publish several events with their confirms in flight together (one round trip)."""
    async with asyncio.timeout(timeout):
        await asyncio.gather(*(publish_event(broker, e, timeout=timeout) for e in events))


async def publish_command(
    broker: RabbitBroker,
    command: ScoreText,
    *,
    timeout: float,
    now: datetime,
    headers: Mapping[str, Any] | None = None,
    sent_again: bool = False,
) -> bool:
    """Send a command now, or down the wait ladder when its `not_before` lies ahead.

    True when it went straight to its work queue (through `scorebox.tasks`, where the status
    projection also takes its copy), False when it waits on the ladder. `sent_again`: a
    command the scorer sends itself (a copy, a retry), whose task the projection has taken
    already; sent now, it goes to the scorer alone (`score.resubmitted`). A copy of a first
    attempt sent after its task's record had expired, a cancelled task's among them, made
    the projection record the task afresh, `queued` for seven days (review of cancellation).

    `now`: the sender's clock, the one its consumer judges `not_before` by (a service's
    `DatabaseClock`). It read the wall clock by default, and a scorer whose wall clock ran
    ahead of the database's sent a command not yet due straight back to itself, over and
    over, for the last seconds of every wait (a re-read: 1,709 rounds in 2 s)."""
    remaining = 0.0
    if command.not_before is not None:
        remaining = (command.not_before - now).total_seconds()
    tier = wait_tier_for(remaining)
    if tier is None:
        await _publish(
            broker,
            command,
            exchange=TASKS,
            routing_key=command.resubmission_routing_key if sent_again else command.routing_key,
            timeout=timeout,
            headers=headers,
        )
        return True
    await _publish(
        broker,
        command,
        exchange=DELAY,
        routing_key=delay_routing_key(tier[0], command.routing_key),
        timeout=timeout,
        headers=headers,
    )
    return False


async def publish_cancel(broker: RabbitBroker, cancel: CancelTask, *, timeout: float) -> None:
    """Send a client's cancellation of a task to the scorer, now (never down the ladder)."""
    await _publish(broker, cancel, exchange=TASKS, routing_key=cancel.routing_key, timeout=timeout)


async def publish_dead_letter(
    broker: RabbitBroker,
    work_queue: WorkQueue,
    *,
    body: bytes,
    headers: Mapping[str, Any],
    error: str,
    timeout: float,
    message_id: str | None = None,
    correlation_id: str | None = None,
    routing_key: str | None = None,
) -> None:
    """Move a message to a work queue's DLQ ourselves, with the reason as a header
    (`letter_headers`). `routing_key`: the key the message was published with, for headers
    that do not name it already (a `Delivery`'s always do)."""
    await send_raw(
        broker,
        body,
        exchange=DLX,
        routing_key=work_queue.dead_letter_routing_key,
        timeout=timeout,
        message_id=message_id,
        correlation_id=correlation_id,
        headers=letter_headers(headers, error=error, queue=work_queue.name, key=routing_key),
    )


# What a letter keeps of a reason.
_REASON_MAX = 1000


def letter_headers(
    headers: Mapping[str, Any], *, error: str, queue: str, key: str | None = None
) -> dict[str, Any]:
    """A letter's headers: the message's own, its reason (`ERROR_HEADER`, 1,000 characters
    at most) and the queue it left. A letter of a letter (moved back to its queue, and
    dead-lettered again) keeps the first one's reason as `FIRST_ERROR_HEADER` (the reasons
    between are in the logs). `key`: the routing key the message was read under
    (`ROUTING_KEY_HEADER`; a letter moved back reads under its first): read back, the
    letter is that message again."""
    letter = {**headers, ERROR_HEADER: error[:_REASON_MAX], DEAD_LETTERED_FROM_HEADER: queue}
    # The broker's count of this delivery, not the letter's: RabbitMQ keeps one a publisher
    # set on a message's first delivery (3.10 too), and a letter moved back would have read
    # as at its delivery limit (consumers now read the count only on a redelivery:
    # `topology.counted_headers`). What earlier copies lost is carried apart
    # (`EARLIER_DELIVERIES_HEADER`).
    letter.pop(DELIVERY_COUNT_HEADER, None)
    if ERROR_HEADER in headers:
        letter.setdefault(FIRST_ERROR_HEADER, str(headers[ERROR_HEADER])[:_REASON_MAX])
    if key is not None:
        # Set, not kept: the key the delivery was read under (a letter moved back already
        # reads as its first key; one published again to its exchange, as the new one).
        letter[ROUTING_KEY_HEADER] = key
    return letter


async def publish_delayed(
    broker: RabbitBroker,
    message: Contract,
    *,
    exchange: RabbitExchange,
    routing_key: str,
    not_before: datetime | None,
    timeout: float,
    now: datetime,
    headers: Mapping[str, Any] | None = None,
    through_ladder: bool = False,
) -> None:
    """Publish any contract to `exchange`/`routing_key` now, or down the wait ladder when
    `not_before` lies ahead (the generalisation of `publish_command`).

    The ladder dead-letters into `scorebox.due` keeping `<tier>.<routing_key>`, so the target
    queue must also be bound to `scorebox.due` with `*.<routing_key>` (see `_command_queue`).
    A consumer that receives the message before `not_before` sends it down the ladder again.
    `through_ladder`: never straight to `exchange`, even when due (at least the shortest
    tier): for a copy meant for the one queue bound to `scorebox.due`, such as an event a
    consumer sends itself again, which `exchange` would hand to every consumer.
    """
    remaining = 0.0
    if not_before is not None:
        remaining = (not_before - now).total_seconds()
    tier = wait_tier_for(max(remaining, WAIT_TIERS[0][1]) if through_ladder else remaining)
    if tier is None:
        await _publish(
            broker,
            message,
            exchange=exchange,
            routing_key=routing_key,
            timeout=timeout,
            headers=headers,
        )
        return
    await publish_through_wait_queue(
        broker, message, tier=tier[0], routing_key=routing_key, timeout=timeout, headers=headers
    )


async def publish_through_wait_queue(
    broker: RabbitBroker,
    message: Contract,
    *,
    tier: str,
    routing_key: str,
    timeout: float,
    headers: Mapping[str, Any] | None = None,
) -> None:
    """Publish to the wait queue of `tier` (a ladder's tier, or one apart such as
    `RESCORES_WAIT_TIER`'s), from which it reaches the queue bound to `scorebox.due` with
    `*.<routing_key>` once the tier's TTL is over."""
    await _publish(
        broker,
        message,
        exchange=DELAY,
        routing_key=delay_routing_key(tier, routing_key),
        timeout=timeout,
        headers=headers,
    )
