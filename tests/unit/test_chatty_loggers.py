"""httpx logs every request at INFO: the gateway's reads of the status service were a log
line each (found in a walkthrough). A service keeps it at WARNING unless it logs at DEBUG."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from services.gateway.settings import GatewaySettings
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
