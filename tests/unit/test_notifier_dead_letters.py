"""What a webhook letter moved back by a replay carries (`moved_back_headers`): read by the
notifier as a letter moved back, whoever dead-lettered it, and as a fresh delivery count; and
how the listing shows a letter's URL."""

from __future__ import annotations

from services.notifier.consumer import MOVED_BACK_REASON, is_moved_back_letter
from services.notifier.dead_letters import moved_back_headers
from shared.dead_letters import UNPARSEABLE_URL, shown_url
from shared.topology import (
    DELIVERY_COUNT_HEADER,
    EARLIER_DELIVERIES_HEADER,
    ERROR_HEADER,
    FIRST_ERROR_HEADER,
    WEBHOOK_DELIVERIES,
    X_DEATH_HEADER,
    deliveries_lost,
)


def test_a_letter_of_ours_keeps_its_reasons() -> None:
    headers = {ERROR_HEADER: "gave up after 8 attempt(s)", FIRST_ERROR_HEADER: "earlier"}

    moved = moved_back_headers(headers)

    assert moved == headers
    assert is_moved_back_letter(moved)


def test_a_letter_of_rabbitmqs_is_named_moved_back_by_our_header() -> None:
    """Its `x-death`, published again by a client, is the broker's to read: RabbitMQ 4 no
    longer takes one a client set as its own record (spring-cloud-stream#3019)."""
    death = {"queue": WEBHOOK_DELIVERIES.name, "reason": "delivery_limit", "count": 1}

    moved = moved_back_headers({X_DEATH_HEADER: [death]})

    assert moved[ERROR_HEADER] == MOVED_BACK_REASON
    assert moved[X_DEATH_HEADER] == [death]


def test_the_delivery_counts_of_its_earlier_copy_are_dropped() -> None:
    """A letter dead-lettered at the delivery limit carried on read as at it again."""
    headers = {ERROR_HEADER: "at its delivery limit", EARLIER_DELIVERIES_HEADER: 20}
    headers[DELIVERY_COUNT_HEADER] = 3

    moved = moved_back_headers(headers)

    assert deliveries_lost(moved) == 0
    assert moved == {ERROR_HEADER: "at its delivery limit"}


def test_a_url_that_does_not_parse_is_listed_as_a_placeholder() -> None:
    """One such letter (another producer's) made the whole listing a 500."""
    assert shown_url("https://h.example:99999/x") == UNPARSEABLE_URL
    assert shown_url("https://u:p@h.example/x?token=t") == "https://h.example/x"
