"""The correlation id (the task id, on every task message) of the delivery being handled,
added to every log record written meanwhile, so that one task's lines can be found across
services (`LOG_FORMAT=json` writes it as the field `correlation_id`)."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar

from aiormq.exceptions import ConnectionClosed

from shared.log_rate import Tally

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
    aiormq's own line ("Unexpected connection close from remote ...", with the broker's
    reply code and text; made a WARNING here) and the reconnection gates' warning already
    report:

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
            if isinstance(record.msg, str) and record.msg.startswith(AIORMQ_CLOSED_BY_THE_BROKER):
                if not logging.getLogger(record.name).isEnabledFor(logging.WARNING):
                    return False  # the level the line now has is not logged
                _as_a_warning(record)
            return not _reader_ended_by_the_brokers_close(record)
        message = record.getMessage()
        return not (
            "RobustChannel._on_close" in message
            and ("No active transport in channel" in message or _connection_closed(message))
        )


def _as_a_warning(record: logging.LogRecord) -> None:
    """aiormq's ERROR for a connection the broker closed, a WARNING: the service rides it out
    (its connections come back, its consumers resume), as it does every other outage, each
    a WARNING; at ERROR it read as a failure to act on (a walkthrough of forced closes)."""
    record.levelno, record.levelname = logging.WARNING, logging.getLevelName(logging.WARNING)


def _connection_closed(message: str) -> bool:
    """aiormq's `RuntimeError` for its connection closed (not a channel's own error)."""
    return "RuntimeError: <Connection: " in message and message.endswith(" closed")


def _reader_ended_by_the_brokers_close(record: logging.LogRecord) -> bool:
    exception = record.exc_info[1] if record.exc_info else None
    return record.msg == READER_EXITED and type(exception) is ConnectionClosed


class RepeatedReconnectAttempts(logging.Filter):
    """Lets through the libraries' line for a failed reconnection attempt once per
    `every_s` for each kind of line, with how many were not shown since. While the broker
    is away, aiormq logs an ERROR "error when creating transport", and aio-pika a WARNING
    "Connection attempt ... failed" and an INFO "Connection to ... closed", for every
    attempt of every connection (one a second each): about six lines a second per service
    at WARNING and above, for the whole outage (a walkthrough). The first of a kind goes
    out at once, so the outage's beginning is seen."""

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic):
        super().__init__()
        self._every_s = every_s
        self._clock = clock
        self._tallies: dict[tuple[str, str], Tally] = {}

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg not in RECONNECT_ATTEMPT_LINES or not isinstance(record.args, tuple):
            return True
        key = (record.name, record.msg)
        tally = self._tallies.setdefault(key, Tally(self._every_s, self._clock))
        if (attempts := tally.count()) is None:
            return False
        if attempts > 1:
            record.msg = f"{record.msg} (%d such lines since the last shown, not shown)"
            record.args = (*record.args, attempts - 1)
        return True


# The libraries' lines for a failed attempt to connect again: aiormq's (`Connection.connect`)
# and aio-pika's (`RobustConnection`'s connection factory loop).
AIORMQ_TRANSPORT_FAILED = "error when creating transport: %r"
AIO_PIKA_ATTEMPT_FAILED = 'Connection attempt to "%s" failed: %s. Reconnecting after %r seconds.'
# aio-pika's INFO for the connection closed, logged after each failed attempt too.
AIO_PIKA_CLOSED = "Connection to %s closed. Reconnecting after %r seconds."
RECONNECT_ATTEMPT_LINES = frozenset(
    {AIORMQ_TRANSPORT_FAILED, AIO_PIKA_ATTEMPT_FAILED, AIO_PIKA_CLOSED}
)
# The loggers whose records `RepeatedReconnectAttempts` thins out.
RECONNECTING_LOGGERS = ("aiormq.connection", "aio_pika.robust_connection")


# aiormq's message (`Connection.__handle_close`) for a `Connection.Close` from the broker.
AIORMQ_CLOSED_BY_THE_BROKER = "Unexpected connection close from remote"
# aiormq's message (`Connection._on_reader_done`) when its reader task ended with an error.
READER_EXITED = "Cancelling cause reader exited abnormally"
# The loggers whose records `KnownLibraryNoise` sifts.
NOISY_LIBRARY_LOGGERS = ("aio_pika.tools", "aiormq.connection")
KNOWN_LIBRARY_NOISE = KnownLibraryNoise()
