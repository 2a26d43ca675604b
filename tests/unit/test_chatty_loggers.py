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
