"""A connection the broker closes (here: its vhost deleted, a forced close) is reported once,
by aiormq's line with the broker's reply, made a WARNING (the service rides it out, as any
outage: at ERROR it read as a failure to act on; a walkthrough); the libraries' other
records of it (aio-pika's
error for each robust channel, aio-pika#668, and aiormq's traceback of the close) told an
operator of failures that were none: the connection's restoration reopens every channel
(`shared.log_context.KnownLibraryNoise`)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator

import aio_pika
import pytest
from aio_pika.abc import AbstractChannel, AbstractRobustConnection

from devtools.infra import Endpoint, create_vhost, delete_vhost
from services.gateway.settings import GatewaySettings
from shared.log_context import NOISY_LIBRARY_LOGGERS
from shared.runtime import CHATTY_LOGGERS, configure_logging
from tests.support import eventually

pytestmark = pytest.mark.integration

CHANNELS = 3


@pytest.fixture
async def own_vhost(rabbitmq: Endpoint) -> AsyncIterator[tuple[str, str]]:
    vhost = f"scorebox-test-close-{uuid.uuid4().hex[:8]}"
    url = create_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    yield vhost, url
    delete_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)


@pytest.fixture
def logging_restored() -> Iterator[None]:
    """`configure_logging` sets levels and takes Python's warnings: undone after the test."""
    levels = {name: logging.getLogger(name).level for name in CHATTY_LOGGERS}
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    logging.captureWarnings(False)


@pytest.mark.usefixtures("logging_restored")
async def test_a_forced_close_is_one_warning_line_and_the_channels_come_back(
    rabbitmq: Endpoint, own_vhost: tuple[str, str], caplog: pytest.LogCaptureFixture
) -> None:
    vhost, url = own_vhost
    configure_logging(GatewaySettings.model_validate({}), "gateway")
    connection: AbstractRobustConnection = await aio_pika.connect_robust(
        url, timeout=10, reconnect_interval=0.2
    )
    try:
        channels = [await connection.channel() for _ in range(CHANNELS)]
        with caplog.at_level(logging.WARNING):
            await asyncio.to_thread(
                delete_vhost, rabbitmq.url, vhost, management_url=rabbitmq.management_url
            )
            await eventually(_closed(connection), what="the broker's close")
            await asyncio.to_thread(
                create_vhost, rabbitmq.url, vhost, management_url=rabbitmq.management_url
            )
            for channel in channels:
                await eventually(_usable(channel), what="each channel restored", timeout_s=30)

        # aio-pika's warnings of each failed attempt to reconnect (the vhost away) stay.
        reported = [r for r in caplog.records if r.name in NOISY_LIBRARY_LOGGERS]
        assert [(r.name, r.levelname) for r in reported] == [("aiormq.connection", "WARNING")], (
            caplog.text
        )
        assert "CONNECTION_FORCED" in reported[0].getMessage()
    finally:
        await asyncio.wait_for(connection.close(), 10)


def _closed(connection: AbstractRobustConnection) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        return connection.transport is None

    return check


def _usable(channel: AbstractChannel) -> Callable[[], Awaitable[bool]]:
    async def check() -> bool:
        try:
            await channel.declare_queue("", exclusive=True, timeout=2)
        except Exception:  # noqa: BLE001 - not back yet
            return False
        return True

    return check
