"""Which task event a usage-meter delivery holds: by its routing key, or for one of the
meter's own retries (`usage.retry`, possibly through a wait tier) by the header it carries."""

from __future__ import annotations

from typing import Any, override

import pytest

from services.scheduler.consumer import usage_event_key
from shared.consumers import Delivery
from shared.topology import EVENT_KEY_HEADER


class Routed(Delivery):
    """A delivery's routing key and headers, without a broker message behind them."""

    def __init__(self, routing_key: str, headers: dict[str, Any] | None = None) -> None:
        self._routing_key = routing_key
        self._headers = headers or {}

    @property
    @override
    def routing_key(self) -> str:
        return self._routing_key

    @property
    @override
    def headers(self) -> dict[str, Any]:
        return self._headers


@pytest.mark.parametrize(
    ("delivery", "key"),
    [
        (Routed("task.completed"), "task.completed"),
        (Routed("task.failed"), "task.failed"),
        (Routed("usage.retry", {EVENT_KEY_HEADER: "task.failed"}), "task.failed"),
        (Routed("w5s.usage.retry", {EVENT_KEY_HEADER: "task.failed"}), "task.failed"),
        (Routed("usage.retry", {EVENT_KEY_HEADER: "task.completed"}), "task.completed"),
        # A retry sent before failures were metered names no event: a completion.
        (Routed("usage.retry"), "task.completed"),
    ],
)
def test_the_event_a_meter_delivery_holds(delivery: Delivery, key: str) -> None:
    assert usage_event_key(delivery) == key
