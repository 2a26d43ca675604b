"""A dead letter moved back to its queue (a shovel, the management UI's "move messages":
through the default exchange, under the queue's name) reads as the message it was: a
delivery's `routing_key` is the key the message was published with, kept in the letter
(`x-scorebox-routing-key`) or in RabbitMQ's `x-death`; and a letter of a letter keeps the
first reason."""

from __future__ import annotations

from datetime import UTC, datetime
from types import SimpleNamespace
from typing import Any, cast

import pytest

from services.notifier.consumer import event_key, is_moved_back_letter
from services.scheduler.consumer import usage_event_key
from shared.acks import ChannelAcks
from shared.bus import letter_headers
from shared.consumers import BatchPart, Delivery
from shared.dead_letters import dead_lettered_at, reason
from shared.event_batches import split_batch
from shared.topology import (
    DEAD_LETTERED_FROM_HEADER,
    DELIVERY_COUNT_HEADER,
    EARLIER_DELIVERIES_HEADER,
    ERROR_HEADER,
    FIRST_ERROR_HEADER,
    ROUTING_KEY_HEADER,
    STATUS_PROJECTION,
    USAGE_METER,
)

Json = dict[str, Any]


def _delivered(routing_key: str, headers: Json | None = None, *, through: str = "") -> Delivery:
    """A delivery that came through exchange `through` (the default exchange: moved back)."""
    raw = SimpleNamespace(
        routing_key=routing_key,
        headers=headers or {},
        body=b"{}",
        exchange=through,
        redelivered=False,
    )
    return Delivery(cast("Any", raw), cast("ChannelAcks", None))


def _death(exchange: str, key: str, queue: str = "q") -> Json:
    return {"exchange": exchange, "routing-keys": [key], "queue": queue, "reason": "rejected"}


@pytest.mark.parametrize(
    ("delivery", "key"),
    [
        (_delivered("task.completed", through="scorebox.events"), "task.completed"),
        (
            _delivered("task.completed", {"x-tenant-id": "acme"}, through="scorebox.events"),
            "task.completed",
        ),
        # A letter published again to its exchange under its event's key, its headers naming
        # the key it had on the wait ladder: read under the old key, it was an unknown event
        # (found in review).
        (
            _delivered(
                "task.failed",
                {
                    ROUTING_KEY_HEADER: "1s.task.failed",
                    "x-death": [_death("scorebox.delay", "1s.task.failed")],
                },
                through="scorebox.events",
            ),
            "task.failed",
        ),
        # A letter of ours, moved back.
        (_delivered(USAGE_METER.name, {ROUTING_KEY_HEADER: "task.failed"}), "task.failed"),
        # One of RabbitMQ's (a reject, the delivery limit), moved back.
        (
            _delivered(USAGE_METER.name, {"x-death": [_death("scorebox.events", "task.failed")]}),
            "task.failed",
        ),
        # ... moved back, dead-lettered by RabbitMQ again, and moved back once more: the copy
        # that came through the default exchange records the queue's name.
        (
            _delivered(
                USAGE_METER.name,
                {
                    "x-death": [
                        _death("", USAGE_METER.name),
                        _death("scorebox.events", "task.failed"),
                    ]
                },
            ),
            "task.failed",
        ),
        # A wait on the ladder: RabbitMQ's death there names the key it is delivered under.
        (
            _delivered(
                "5s.usage.retry",
                {"x-death": [_death("scorebox.delay", "5s.usage.retry")]},
                through="scorebox.due",
            ),
            "5s.usage.retry",
        ),
        # Our letter of a message RabbitMQ dead-lettered before: ours names the first key.
        (
            _delivered(
                USAGE_METER.name,
                {ROUTING_KEY_HEADER: "task.completed", "x-death": [_death("", USAGE_METER.name)]},
            ),
            "task.completed",
        ),
    ],
)
def test_a_delivery_reads_the_key_its_message_was_published_with(
    delivery: Delivery, key: str
) -> None:
    assert delivery.routing_key == key


def test_a_part_of_a_batch_moved_back_reads_the_batchs_key() -> None:
    headers: Json = {"x-batch": 1, ROUTING_KEY_HEADER: "task.completed"}
    batch_headers = headers | {"x-scorebox-batch": [[2, "m-1", "t-1", "acme"]]}
    [part] = split_batch(b"[{}]", batch_headers)
    raw = SimpleNamespace(
        routing_key=STATUS_PROJECTION.name,
        headers=batch_headers,
        body=b"[{}]",
        exchange="",
        redelivered=False,
    )
    delivery = BatchPart(cast("Any", raw), cast("ChannelAcks", None), part)
    assert delivery.routing_key == "task.completed"
    assert delivery.headers["x-tenant-id"] == "acme"


def test_the_usage_meter_reads_a_moved_back_failure_as_a_failure() -> None:
    """It read a key it did not know as a retry of a completion, and the failure's body as
    an unreadable completion."""
    letter = _delivered(USAGE_METER.name, {ROUTING_KEY_HEADER: "task.failed"})
    assert usage_event_key(letter) == "task.failed"


def test_the_notifier_reads_a_moved_back_event_of_the_ladder_without_its_tier() -> None:
    letter = _delivered("scorebox.notifications", {ROUTING_KEY_HEADER: "1s.task.completed"})
    assert event_key(letter.routing_key) == "task.completed"


def test_a_letter_names_the_reason_the_queue_and_the_key() -> None:
    headers = letter_headers(
        {"x-tenant-id": "acme"}, error="refused", queue=STATUS_PROJECTION.name, key="task.failed"
    )
    assert headers == {
        "x-tenant-id": "acme",
        ERROR_HEADER: "refused",
        DEAD_LETTERED_FROM_HEADER: STATUS_PROJECTION.name,
        ROUTING_KEY_HEADER: "task.failed",
    }


def test_a_letter_leaves_the_brokers_delivery_count_behind_and_keeps_what_copies_lost() -> None:
    """RabbitMQ 4.x keeps an `x-delivery-count` a publisher set: a letter carrying its
    delivery's count, moved back, read as at its delivery limit at once."""
    headers = letter_headers(
        {DELIVERY_COUNT_HEADER: 4, EARLIER_DELIVERIES_HEADER: 1},
        error="gave up",
        queue="q",
        key="task.failed",
    )
    assert DELIVERY_COUNT_HEADER not in headers
    assert headers[EARLIER_DELIVERIES_HEADER] == 1


def test_a_letter_of_a_letter_keeps_the_first_reason_and_the_first_key() -> None:
    first = letter_headers({}, error="the first cause", queue="q", key="task.failed")
    # Moved back, the letter is read under the key it names: its letter names that one.
    moved_back = _delivered("q", first)
    second = letter_headers(first, error="another cause", queue="q", key=moved_back.routing_key)
    third = letter_headers(second, error="a third cause", queue="q", key="task.failed")
    assert second[ERROR_HEADER] == "another cause"
    assert second[FIRST_ERROR_HEADER] == "the first cause"
    assert (third[ERROR_HEADER], third[FIRST_ERROR_HEADER]) == ("a third cause", "the first cause")
    assert third[ROUTING_KEY_HEADER] == "task.failed"


def test_a_letter_published_again_and_dead_lettered_names_the_key_it_came_under() -> None:
    """Published again to its exchange under its event's key, then dead-lettered: its letter
    kept the key it had on the wait ladder, and moved back it was an unknown event (found in
    review)."""
    stale = letter_headers({}, error="cause", queue="q", key="1s.task.failed")
    republished = _delivered("task.failed", stale, through="scorebox.events")
    again = letter_headers(stale, error="cause", queue="q", key=republished.routing_key)
    assert _delivered("q", again).routing_key == "task.failed"


def test_a_letter_of_a_letter_is_listed_with_both_reasons() -> None:
    """`scorebox dlq` and `cron dlq` listed the latest reason only: often the letter's own
    handling of the move, not the cause to mend."""
    first = letter_headers({}, error="the first cause", queue="q", key="task.failed")
    assert reason(first) == "the first cause"
    second = letter_headers(first, error="another cause", queue="q", key="q")
    assert reason(second) == "another cause (first dead-lettered for: the first cause)"


def test_a_letters_reason_is_bounded() -> None:
    headers = letter_headers({ERROR_HEADER: "x" * 5000}, error="y" * 5000, queue="q")
    assert len(headers[ERROR_HEADER]) == 1000
    assert headers[FIRST_ERROR_HEADER] == "x" * 1000


# An `x-death` a publisher set by hand, not RabbitMQ's list of tables.
MALFORMED_DEATHS = [
    {"x-death": "rejected"},
    {"x-death": ["rejected", 3]},
    {"x-death": [{"exchange": "scorebox.events", "routing-keys": "task.failed"}]},
    {"x-death": [{"exchange": "scorebox.events", "routing-keys": []}]},
]


@pytest.mark.parametrize("headers", MALFORMED_DEATHS)
def test_a_malformed_x_death_reads_as_no_death(headers: Json) -> None:
    """The DLQ listings and the consumers read it as a letter without a known death: the
    listing of a queue holding one failed (a string's `.get`), and a delivery read the first
    character of a key given as a string."""
    raw = SimpleNamespace(
        headers=headers, timestamp=None, message_id=None, body=b"{}", routing_key="q"
    )
    assert reason(headers) in {"unknown", "dead-lettered by RabbitMQ (x-death, from None)"}
    assert dead_lettered_at(cast("Any", raw), datetime.now(UTC)) is None
    assert _delivered("q", headers).routing_key == "q"
    assert not is_moved_back_letter(headers)
