"""What the log and a client read while the broker refuses: a line a minute at most for the
submissions it did not take (one per refusal flooded the log: 318 lines for 159 refusals in a
14 s outage), and an error in words, never an object's repr (a walkthrough)."""

from __future__ import annotations

import logging

import aiormq
import pytest
from faststream.rabbit import RabbitBroker

from services.gateway.errors import BrokerUnavailable
from services.gateway.publisher import TaskPublisher
from shared.bus import error_words
from shared.contracts import ScoreText


def test_an_objects_repr_in_an_error_is_named_by_its_class() -> None:
    class RobustChannel:
        pass

    error = aiormq.exceptions.ChannelInvalidStateError(f"{RobustChannel()!r} closed")
    assert error_words(error) == "ChannelInvalidStateError: RobustChannel closed"
    assert error_words(TimeoutError()) == "TimeoutError"


async def test_submissions_the_broker_does_not_take_are_one_line_with_their_count(
    caplog: pytest.LogCaptureFixture,
) -> None:
    broker = RabbitBroker("amqp://guest:guest@127.0.0.1:1/")  # never connected
    publisher = TaskPublisher(broker, timeout_s=1)
    with caplog.at_level(logging.WARNING, logger="scorebox.gateway.publisher"):
        for i in range(5):
            with pytest.raises(BrokerUnavailable):
                await publisher.send(ScoreText(task_id=f"t{i}", text="hello"))
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("score.requested not taken (1 since the last line), the latest for t0")
    assert " object at 0x" not in line
