"""A copy of a cron delivery handed back (a stop, a database outage) keeps what lets it in."""

from __future__ import annotations

from datetime import UTC, datetime

from services.scheduler.consumer import handed_back, run_delivery
from shared.contracts import RunCronJob
from shared.topology import EARLIER_DELIVERIES_HEADER
from tests.support import HandedDelivery

AT = datetime(2030, 1, 1, 10, 5, tzinfo=UTC)
COMMAND = RunCronJob(task_id="run-1", job="rollup", scheduled_for=AT, fired_at=AT)


def _copy_of(message: HandedDelivery, handling: str) -> HandedDelivery:
    return HandedDelivery(message.body, headers=handed_back(message, handling))


def test_a_copy_handed_back_replaces_its_handling_under_the_same_message_id() -> None:
    copy = _copy_of(HandedDelivery(COMMAND.model_dump_json().encode()), "cut-short")
    delivery = run_delivery(COMMAND, copy, "next")
    assert (delivery.message_id, delivery.replaces, delivery.takes_over) == (
        COMMAND.message_id,
        "cut-short",
        False,
    )


def test_a_redelivery_handed_back_still_takes_the_run_over() -> None:
    """Its run is held by the handling that died with it, which the copy cannot name:
    without the takeover the copy was refused, and the run waited to be abandoned."""
    redelivery = HandedDelivery.redelivery(COMMAND.model_dump_json().encode(), count=2)
    copy = _copy_of(redelivery, "cut-short")
    assert copy.headers[EARLIER_DELIVERIES_HEADER] == 2
    assert run_delivery(COMMAND, copy, "next").takes_over
