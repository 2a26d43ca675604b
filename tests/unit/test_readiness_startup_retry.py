"""The start-up retries name what failed, whatever the error: a dependency waited for
(RabbitMQ, MongoDB) is the first thing an operator reads about when a service will not start."""

from __future__ import annotations

import logging

import pytest

from shared.runtime import retry_until


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
    assert "not reachable yet (TimeoutError())" in warning
