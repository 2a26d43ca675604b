"""httpx logs every request at INFO: the gateway's reads of the status service were a log
line each (found in a walkthrough). A service keeps it at WARNING unless it logs at DEBUG."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from dataclasses import dataclass

import aio_pika.robust_connection
import aiormq.connection
import pytest

from services.gateway.settings import GatewaySettings
from shared.log_context import (
    AIO_PIKA_ATTEMPT_FAILED,
    AIO_PIKA_CLOSED,
    AIORMQ_TRANSPORT_FAILED,
    RECONNECTING_LOGGERS,
    KnownLibraryNoise,
    RepeatedReconnectAttempts,
)
from shared.runtime import CHATTY_LOGGERS, configure_logging


@pytest.fixture
def chatty_levels_restored() -> Iterator[None]:
    levels = {name: logging.getLogger(name).level for name in CHATTY_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(False)  # configure_logging took Python's warnings


@pytest.mark.usefixtures("chatty_levels_restored")
@pytest.mark.parametrize(("log_level", "httpx_level"), [("INFO", "WARNING"), ("DEBUG", "NOTSET")])
def test_httpx_logs_its_requests_only_when_the_service_logs_at_debug(
    log_level: str, httpx_level: str
) -> None:
    logging.getLogger("httpx").setLevel(logging.NOTSET)
    configure_logging(GatewaySettings.model_validate({"LOG_LEVEL": log_level}), "gateway")
    assert logging.getLevelName(logging.getLogger("httpx").level) == httpx_level


@pytest.mark.usefixtures("chatty_levels_restored")
def test_aio_pikas_error_for_each_channel_of_a_lost_connection_is_dropped(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """aio-pika#668: its robust channel's own attempt to reopen on a connection gone is
    logged as an error, though the connection's restoration reopens it (a walkthrough saw
    two or three per connection lost). Its other errors stay."""
    configure_logging(GatewaySettings.model_validate({}), "gateway")
    tools = logging.getLogger("aio_pika.tools")
    callback = "<OneShotCallback: cb=<bound method RobustChannel._on_close of <channel>>>"

    with caplog.at_level(logging.ERROR, logger="aio_pika.tools"):
        tools.error(
            "Callback %r error: %s: %s",
            callback,
            "ChannelInvalidStateError",
            "No active transport in channel",
        )
        tools.error("Callback %r error: %s: %s", "<other>", "RuntimeError", "boom")

    assert [record.getMessage() for record in caplog.records if record.name == tools.name] == [
        "Callback '<other>' error: RuntimeError: boom"
    ]


@dataclass
class Clock:
    now: float = 0.0

    def __call__(self) -> float:
        return self.now


def _attempt_failed(logger: logging.Logger, message: str) -> None:
    refused = ConnectionRefusedError(111, "Connect call failed ('127.0.0.1', 5672)")
    if message == AIORMQ_TRANSPORT_FAILED:
        logger.error(message, refused)
    elif message == AIO_PIKA_CLOSED:
        logger.info(message, "amqp://guest:******@127.0.0.1:5672/", 1.0)
    else:
        logger.warning(message, "amqp://guest:******@127.0.0.1:5672/", refused, 1.0)


@pytest.mark.parametrize(
    ("logger_name", "message"),
    [
        ("aiormq.connection", AIORMQ_TRANSPORT_FAILED),
        ("aio_pika.robust_connection", AIO_PIKA_ATTEMPT_FAILED),
        ("aio_pika.robust_connection", AIO_PIKA_CLOSED),
    ],
)
def test_a_failed_reconnection_attempt_is_told_once_a_minute_with_the_count(
    caplog: pytest.LogCaptureFixture, logger_name: str, message: str
) -> None:
    """The libraries log each attempt of each connection while the broker is away: about
    six lines a second per service, for the whole outage (a walkthrough)."""
    clock = Clock()
    logger = logging.getLogger(f"tests.{logger_name}")
    thinning = RepeatedReconnectAttempts(every_s=60.0, clock=clock)
    logger.addFilter(thinning)
    try:
        with caplog.at_level(logging.INFO, logger=logger.name):
            for _ in range(120):  # two minutes of attempts, one a second
                _attempt_failed(logger, message)
                clock.now += 1.0
            _attempt_failed(logger, message)
            logger.error("Unexpected connection close from remote: 320")  # passes untouched
    finally:
        logger.removeFilter(thinning)

    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 4, lines
    assert "such lines" not in lines[0]  # the outage's beginning, at once
    assert lines[1].endswith(" (59 such lines since the last shown, not shown)")
    assert lines[2].endswith(" (59 such lines since the last shown, not shown)")
    assert lines[3] == "Unexpected connection close from remote: 320"


def test_the_thinned_lines_are_the_libraries_own() -> None:
    """The lines are matched by their text: a release of aiormq or aio-pika that words them
    otherwise must be met here, not in an outage."""
    assert repr(AIORMQ_TRANSPORT_FAILED)[1:-1] in inspect.getsource(aiormq.connection)
    robust = inspect.getsource(aio_pika.robust_connection)
    assert "'Connection attempt to \"%s\" failed: %s. '" in robust
    assert '"Reconnecting after %r seconds."' in robust
    assert f'"{AIO_PIKA_CLOSED}"' in robust
    assert AIO_PIKA_ATTEMPT_FAILED == 'Connection attempt to "%s" failed: %s. ' + (
        "Reconnecting after %r seconds."
    )


@pytest.mark.usefixtures("chatty_levels_restored")
def test_every_service_thins_out_the_reconnection_attempts_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    for _ in range(2):  # services built side by side in one process configure it each
        configure_logging(GatewaySettings.model_validate({}), "gateway")
    for name in RECONNECTING_LOGGERS:
        filters = logging.getLogger(name).filters
        assert sum(isinstance(f, RepeatedReconnectAttempts) for f in filters) == 1, name
    with caplog.at_level(logging.INFO, logger="aiormq.connection"):
        for _ in range(5):
            _attempt_failed(logging.getLogger("aiormq.connection"), AIORMQ_TRANSPORT_FAILED)
    assert len([r for r in caplog.records if r.name == "aiormq.connection"]) <= 1


class Collected(logging.Handler):
    """A handler of every level (as `basicConfig`'s), keeping what reaches it."""

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.mark.parametrize(("level", "shown"), [(logging.WARNING, True), (logging.ERROR, False)])
def test_the_brokers_close_of_a_connection_is_a_warning_shown_as_one(
    level: int, shown: bool
) -> None:
    """aiormq logs it as an ERROR; the service rides it out, as it does every outage, each a
    WARNING (a walkthrough). Made a WARNING after the logger let it through as an ERROR, it
    must not reach a handler where warnings are not logged (`LOG_LEVEL=ERROR`; the re-read)."""
    logger = logging.getLogger("aiormq.connection")
    noise, collected = KnownLibraryNoise(), Collected()
    logger.addFilter(noise)
    logger.addHandler(collected)
    before = logger.level
    logger.setLevel(level)
    try:
        logger.error(
            'Unexpected connection close from remote "%s", '
            "Connection.Close(reply_code=%r, reply_text=%r)",
            "amqp://guest:******@127.0.0.1:5672/",
            320,
            "CONNECTION_FORCED - broker forced connection closure",
        )
    finally:
        logger.removeFilter(noise)
        logger.removeHandler(collected)
        logger.setLevel(before)
    assert [record.levelname for record in collected.records] == (["WARNING"] if shown else [])
