"""The start-up retries name what failed, whatever the error: a dependency waited for
(RabbitMQ, MongoDB) is the first thing an operator reads about when a service will not start."""

from __future__ import annotations

import asyncio
import logging

import pytest

from shared.runtime import DependencyUnreachable, _named_on_timeout, retry_until


async def test_a_start_up_retry_names_an_error_without_a_message(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A timeout's message is empty: the warning read "not reachable yet ()"."""
    attempts: list[int] = []

    async def connect() -> None:
        attempts.append(1)
        if len(attempts) == 1:
            raise TimeoutError

    with caplog.at_level(logging.WARNING, logger="scorebox.runtime"):
        await retry_until(connect, what="RabbitMQ at amqp://broker", deadline_s=30)

    # Only this logger's: other tests' connections still retrying log here too.
    [warning] = [r.getMessage() for r in caplog.records if r.name == "scorebox.runtime"]
    assert "reaching RabbitMQ at amqp://broker failed (TimeoutError())" in warning


async def test_a_start_up_past_its_deadline_names_the_dependency_and_its_last_error() -> None:
    async def refused() -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    with pytest.raises(DependencyUnreachable) as unreachable:
        await retry_until(refused, what="RabbitMQ at amqp://broker", deadline_s=0.3)
    assert str(unreachable.value).startswith(
        "RabbitMQ at amqp://broker not reachable within STARTUP_TIMEOUT_S (0.3 s); its last "
        "error: ConnectionRefusedError(111, 'Connection refused')"
    )


async def test_a_first_attempt_cut_short_by_the_deadline_still_names_the_dependency(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """`STARTUP_TIMEOUT_S` under `MONGO_TIMEOUT_S`: the first attempt was still waiting when
    the deadline came, nothing was logged, and the start ended on a bare `TimeoutError`
    (a walkthrough)."""

    async def unanswered() -> None:
        await asyncio.Event().wait()

    with (
        caplog.at_level(logging.ERROR, logger="scorebox.runtime"),
        pytest.raises(DependencyUnreachable, match="its first attempt had no answer yet"),
    ):
        await retry_until(unanswered, what="MongoDB", deadline_s=0.1)
    [error] = [r.getMessage() for r in caplog.records if r.name == "scorebox.runtime"]
    assert error.startswith("MongoDB not reachable within STARTUP_TIMEOUT_S (0.1 s)")


async def test_a_timeout_of_a_step_s_own_bound_is_not_taken_for_the_start_up_s() -> None:
    """A consumer's start bounded by `BROKER_TIMEOUT_S` inside the start-up's deadline was
    reported as "not done within STARTUP_TIMEOUT_S", naming the wrong bound (a
    review)."""
    with pytest.raises(TimeoutError, match="the consumer's own") as raised:
        async with _named_on_timeout("RabbitMQ at amqp://broker", 30):
            raise TimeoutError("the consumer's own")
    assert not isinstance(raised.value, DependencyUnreachable)

    with pytest.raises(DependencyUnreachable, match="not done within STARTUP_TIMEOUT_S"):
        async with _named_on_timeout("RabbitMQ at amqp://broker", 0.05):
            await asyncio.Event().wait()


async def test_a_start_up_retry_waits_for_its_whole_deadline() -> None:
    """Given up before a wait that would pass the deadline, a start ended up to 5 s short of
    the `STARTUP_TIMEOUT_S` its message named (a re-read: 8.9 s of 12)."""

    async def refused() -> None:
        raise ConnectionRefusedError(111, "Connection refused")

    loop = asyncio.get_running_loop()
    began = loop.time()
    with pytest.raises(DependencyUnreachable):
        await retry_until(refused, what="RabbitMQ at amqp://broker", deadline_s=1.5)
    assert loop.time() - began >= 1.5
