"""The correlation id (the task id, on every task message) of the delivery being handled,
added to every log record written meanwhile, so that one task's lines can be found across
services (`LOG_FORMAT=json` writes it as the field `correlation_id`)."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from contextvars import ContextVar

from aiormq.exceptions import ConnectionClosed

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
    """Drops two library records that tell of nothing but a broker connection lost, which
    aiormq's own ERROR line ("Unexpected connection close from remote ...", with the
    broker's reply code and text) and the reconnection gates' warning already report:

    - aio-pika's error for each channel of the connection, whose robust copy tries to
      reopen itself on the connection gone (`RobustChannel._on_close`: "No active transport
      in channel", or the connection's own "... closed", aio-pika#668): the connection's
      restoration reopens every channel, so the lines, two or three per connection lost,
      told an operator of failures that were none (walkthroughs);
    - aiormq's warning that its reader exited, with the traceback of the broker's
      `Connection.Close` (a plain `ConnectionClosed`, such as a forced close). Its other
      causes (a malformed frame, a socket error) keep their traceback.
    """

    def filter(self, record: logging.LogRecord) -> bool:
        if record.name == "aiormq.connection":
            return not _reader_ended_by_the_brokers_close(record)
        message = record.getMessage()
        return not (
            "RobustChannel._on_close" in message
            and ("No active transport in channel" in message or _connection_closed(message))
        )


def _connection_closed(message: str) -> bool:
    """aiormq's `RuntimeError` for its connection closed (not a channel's own error)."""
    return "RuntimeError: <Connection: " in message and message.endswith(" closed")


def _reader_ended_by_the_brokers_close(record: logging.LogRecord) -> bool:
    exception = record.exc_info[1] if record.exc_info else None
    return record.msg == READER_EXITED and type(exception) is ConnectionClosed


# aiormq's message (`Connection._on_reader_done`) when its reader task ended with an error.
READER_EXITED = "Cancelling cause reader exited abnormally"
# The loggers whose records `KnownLibraryNoise` sifts.
NOISY_LIBRARY_LOGGERS = ("aio_pika.tools", "aiormq.connection")
KNOWN_LIBRARY_NOISE = KnownLibraryNoise()
