"""What the log and a client read while the broker refuses: a line a minute at most for the
submissions it did not take (one per refusal flooded the log: 318 lines for 159 refusals in a
14 s outage), and an error in words, never an object's repr (a walkthrough)."""

from __future__ import annotations

import logging

import aiormq
import pytest
from faststream.rabbit import RabbitBroker

from services.gateway import publisher as publisher_module
from services.gateway.errors import BrokerUnavailable
from services.gateway.publisher import TaskPublisher
from shared.bus import PublishUnconfirmed, error_words
from shared.contracts import ScoreText, utcnow


def test_an_objects_repr_in_an_error_is_named_by_its_class() -> None:
    class RobustChannel:
        pass

    error = aiormq.exceptions.ChannelInvalidStateError(f"{RobustChannel()!r} closed")
    assert error_words(error) == "ChannelInvalidStateError: RobustChannel closed"
    assert error_words(TimeoutError()) == "TimeoutError"


async def test_submissions_the_broker_does_not_take_are_one_line_with_their_count(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def refused(*args: object, **kwargs: object) -> bool:
        raise aiormq.exceptions.ChannelInvalidStateError("<RobustChannel object at 0x7f01> closed")

    monkeypatch.setattr(publisher_module, "publish_command", refused)
    publisher = TaskPublisher(
        RabbitBroker("amqp://guest:guest@127.0.0.1:1/"), clock=utcnow, timeout_s=1
    )
    with caplog.at_level(logging.WARNING, logger="scorebox.gateway.publisher"):
        for i in range(5):
            with pytest.raises(BrokerUnavailable):
                await publisher.send(ScoreText(task_id=f"t{i}", text="hello"))
    [line] = [record.getMessage() for record in caplog.records]
    assert line.startswith("score.requested not taken (1 since the last line), the latest for t0")
    assert " object at 0x" not in line


async def test_each_kind_of_send_failure_has_its_own_line_and_a_bug_its_traceback(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One count for both hid the refusals behind an unconfirmed line, then told them as
    unconfirmed; and a bug went down the quiet path, one line a minute, no traceback (a
    review). The broker's answers are played by the publish function here: RabbitMQ does
    not leave a publish unconfirmed on demand."""
    failures: list[Exception] = [
        PublishUnconfirmed("no confirm in time"),
        aiormq.exceptions.ChannelInvalidStateError("closed"),
        aiormq.exceptions.ChannelInvalidStateError("closed"),
        TypeError("a bug"),
        TypeError("a bug"),
    ]

    async def publish(*args: object, **kwargs: object) -> bool:
        raise failures.pop(0)

    monkeypatch.setattr(publisher_module, "publish_command", publish)
    publisher = TaskPublisher(
        RabbitBroker("amqp://guest:guest@127.0.0.1:1/"), clock=utcnow, timeout_s=1
    )
    with caplog.at_level(logging.WARNING, logger="scorebox.gateway.publisher"):
        assert await publisher.send(ScoreText(task_id="t0", text="hello")) is False
        for i in range(1, 5):
            with pytest.raises(BrokerUnavailable):
                await publisher.send(ScoreText(task_id=f"t{i}", text="hello"))
    lines = [(record.levelno, record.getMessage()) for record in caplog.records]
    assert [message.split(" (")[0] for _, message in lines[:2]] == [
        "score.requested unconfirmed",
        "score.requested not taken",
    ]
    bugs = [record for record in caplog.records if record.levelno == logging.ERROR]
    assert len(bugs) == 2
    assert all(record.exc_info for record in bugs)
