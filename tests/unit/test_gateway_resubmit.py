"""`TaskPublisher.resubmit` tells a failure of the broker from any other error: a re-score's
request retries the broker's every 10 minutes for as long as they last (never dead-lettered),
so anything else taken for the broker's was retried for ever (a re-read)."""

from __future__ import annotations

from typing import Any

import pytest
from faststream.rabbit import RabbitBroker

from services.gateway import publisher as publisher_module
from services.gateway.errors import BrokerUnavailable
from services.gateway.publisher import TaskPublisher
from shared.bus import PublishUnconfirmed
from shared.contracts import ScoreText, new_id, utcnow


def _failing_with(error: Exception) -> Any:
    async def publish(*_args: object, **_kwargs: object) -> None:
        raise error

    return publish


async def test_a_broker_failure_is_broker_unavailable(monkeypatch: pytest.MonkeyPatch) -> None:
    unconfirmed = PublishUnconfirmed("no confirm within 5 s")
    monkeypatch.setattr(publisher_module, "publish_delayed", _failing_with(unconfirmed))
    sender = TaskPublisher(RabbitBroker(), clock=utcnow, timeout_s=5)

    with pytest.raises(BrokerUnavailable):
        await sender.resubmit(ScoreText(task_id=new_id(), text="An essay."))


async def test_any_other_error_is_raised_as_it_is(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(publisher_module, "publish_delayed", _failing_with(ValueError("a bug")))
    sender = TaskPublisher(RabbitBroker(), clock=utcnow, timeout_s=5)

    with pytest.raises(ValueError, match="a bug"):
        await sender.resubmit(ScoreText(task_id=new_id(), text="An essay."))
