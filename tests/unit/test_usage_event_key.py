"""Which task event a usage-meter delivery holds: by its routing key, or for one of the
meter's own retries (`usage.retry`, possibly through a wait tier) by the header it carries."""

from __future__ import annotations

import pytest

from services.scheduler.consumer import usage_event_key
from shared.consumers import Delivery
from shared.topology import EVENT_KEY_HEADER
from tests.support import HandedDelivery


@pytest.mark.parametrize(
    ("delivery", "key"),
    [
        (HandedDelivery(routing_key="task.completed"), "task.completed"),
        (HandedDelivery(routing_key="task.failed"), "task.failed"),
        (
            HandedDelivery(routing_key="usage.retry", headers={EVENT_KEY_HEADER: "task.failed"}),
            "task.failed",
        ),
        (
            HandedDelivery(routing_key="5s.usage.retry", headers={EVENT_KEY_HEADER: "task.failed"}),
            "task.failed",
        ),
        (
            HandedDelivery(routing_key="usage.retry", headers={EVENT_KEY_HEADER: "task.completed"}),
            "task.completed",
        ),
        # A retry sent before failures were metered names no event: a completion.
        (HandedDelivery(routing_key="usage.retry"), "task.completed"),
    ],
)
def test_the_event_a_meter_delivery_holds(delivery: Delivery, key: str) -> None:
    assert usage_event_key(delivery) == key
