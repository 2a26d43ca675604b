"""While the broker is away, aiormq and aio-pika log a line for every failed attempt of every
connection to come back: `RepeatedReconnectAttempts` lets each kind through once a minute,
with the count of those not shown. On the real broker, its connection cut by a proxy."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import aio_pika
import pytest

from shared.log_context import (
    RECONNECT_ATTEMPT_LINES,
    RECONNECTING_LOGGERS,
    RepeatedReconnectAttempts,
)
from tests.faults.slow_link import SlowLink
from tests.support import eventually

ATTEMPTS = 30


class CountingAttempts(logging.Filter):
    """Counts the libraries' failed-attempt lines before anything thins them."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        self.count += record.msg in RECONNECT_ATTEMPT_LINES
        return True


@contextmanager
def _filtered(*filters: logging.Filter) -> Iterator[None]:
    """The libraries' loggers with `filters` alone, in order, for the block: a service
    configured earlier in this process (`configure_logging`) left its own there."""
    loggers = [logging.getLogger(name) for name in RECONNECTING_LOGGERS]
    before = {logger.name: list(logger.filters) for logger in loggers}
    for logger in loggers:
        logger.filters = list(filters)
    try:
        yield
    finally:
        for logger in loggers:
            logger.filters = before[logger.name]


async def test_a_broker_away_logs_each_kind_of_attempt_line_once(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    attempts = CountingAttempts()
    link = SlowLink.to(amqp_url)
    with _filtered(attempts, RepeatedReconnectAttempts()), caplog.at_level(logging.INFO):
        async with link.running():
            connection = await aio_pika.connect_robust(
                link.url_through(amqp_url), reconnect_interval=0.05
            )
            try:
                await link.cut()

                async def many_attempts() -> bool:
                    return attempts.count >= ATTEMPTS

                await eventually(many_attempts, what=f"{ATTEMPTS} failed attempts logged")
            finally:
                await connection.close()

    shown = [
        record.getMessage()
        for record in caplog.records
        if any(record.msg.startswith(line) for line in RECONNECT_ATTEMPT_LINES)
    ]
    # One line of each kind, the first at once; the next of each would come a minute later.
    assert 1 <= len(shown) <= len(RECONNECT_ATTEMPT_LINES), shown
