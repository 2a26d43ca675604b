"""The correlation id (the task id, on every task message) of the delivery being handled,
added to every log record written meanwhile, so that one task's lines can be found across
services (`LOG_FORMAT=json` writes it as the field `correlation_id`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar

_CORRELATION_ID: ContextVar[str | None] = ContextVar("scorebox_correlation_id", default=None)


@contextlib.contextmanager
def correlated(correlation_id: str | None) -> Iterator[None]:
    """Records logged in this block, and in tasks it starts, carry `correlation_id`."""
    token = _CORRELATION_ID.set(correlation_id)
    try:
        yield
    finally:
        _CORRELATION_ID.reset(token)


class CorrelationFilter(logging.Filter):
    """Adds `correlation_id` to a record logged while a delivery is handled."""

    def filter(self, record: logging.LogRecord) -> bool:
        correlation_id = _CORRELATION_ID.get()
        if correlation_id is not None and not hasattr(record, "correlation_id"):
            record.correlation_id = correlation_id
        return True


class KnownLibraryNoise(logging.Filter):
    """Drops the error aio-pika logs for each channel of a connection lost, whose robust
    copy tries to reopen itself on a connection with no transport (`RobustChannel._on_close`:
    "No active transport in channel", aio-pika#668): the connection's own restoration
    reopens every channel, so the line and its traceback, two or three per connection lost,
    told an operator of a failure that was none (a walkthrough)."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not (
            "RobustChannel._on_close" in message and "No active transport in channel" in message
        )


KNOWN_LIBRARY_NOISE = KnownLibraryNoise()
