"""Fixtures: the real RabbitMQ and MongoDB (or the labelled stand-in), one vhost and one set
of databases per test module, brokers on the module's vhost (`task_broker`, and
`stalled_broker` that never confirms), the fake model server, and in-process services."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from faststream.rabbit import RabbitBroker

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from devtools.infra import Endpoint, create_vhost, delete_vhost, resolve_mongo, resolve_rabbitmq
from shared.runtime import make_broker, start_broker
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink

STALLED_S = 3600.0  # a broker's frames held back that long: it answers nothing

_MARKERS = {"integration": "integration", "e2e": "e2e", "faults": "faults"}
# Keys a developer's shell may export: each changes what the services under test admit.
_SHELL_KEYS = ("ADMIN_API_KEY", "METRICS_API_KEY", "INTERNAL_API_KEY")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        folder = Path(str(item.fspath)).parent.name
        if folder in _MARKERS:
            item.add_marker(getattr(pytest.mark, _MARKERS[folder]))


def _announce(config: pytest.Config, line: str) -> None:
    reporter = config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(line)


@pytest.fixture(scope="session", autouse=True)
def _no_service_keys_from_the_shell() -> Iterator[None]:
    with pytest.MonkeyPatch.context() as patch:
        for name in _SHELL_KEYS:
            patch.delenv(name, raising=False)
        yield


@pytest.fixture(scope="session")
def rabbitmq(pytestconfig: pytest.Config) -> Iterator[Endpoint]:
    endpoint = resolve_rabbitmq()
    _announce(pytestconfig, f"[infra] broker: {endpoint.kind}")
    yield endpoint
    endpoint.close()


@pytest.fixture(scope="session")
def mongo(pytestconfig: pytest.Config) -> Iterator[Endpoint]:
    endpoint = resolve_mongo()
    _announce(pytestconfig, f"[infra] database: {endpoint.kind}")
    yield endpoint
    endpoint.close()


@pytest.fixture(scope="module")
def amqp_url(rabbitmq: Endpoint) -> Iterator[str]:
    """A vhost of this module's own, so tests never see each other's queues."""
    vhost = f"scorebox-test-{uuid.uuid4().hex[:10]}"
    url = create_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    yield url
    delete_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)


@pytest.fixture(scope="module")
def db_prefix() -> str:
    return f"t{uuid.uuid4().hex[:10]}"


@pytest.fixture
async def fake_llm() -> AsyncIterator[FakeLLM]:
    server = await start_fake_llm(FakeLLMConfig())
    yield server
    await server.stop()


@pytest.fixture
async def database_link(mongo: Endpoint) -> AsyncIterator[SlowLink]:
    """A TCP proxy of this test's own to the test database, to slow or cut (`SlowLink`)."""
    async with SlowLink.to(mongo.url).running() as link:
        yield link


@pytest.fixture
async def broker_link(amqp_url: str) -> AsyncIterator[SlowLink]:
    """A TCP proxy of this test's own to the test broker, to slow or cut (`SlowLink`)."""
    async with SlowLink.to(amqp_url).running() as link:
        yield link


@pytest.fixture(scope="module")
async def task_broker(amqp_url: str) -> AsyncIterator[RabbitBroker]:
    """The module's vhost, its topology declared, as the services connect to it (a publish no
    queue takes raises); nothing consumes the commands sent."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url})
    broker = make_broker(settings, graceful_timeout_s=1.0)
    await start_broker(broker, settings)
    yield broker
    await broker.stop()


@pytest.fixture
async def stalled_broker(amqp_url: str, broker_link: SlowLink) -> AsyncIterator[RabbitBroker]:
    """The module's vhost, its topology declared, reached through `broker_link`, which holds
    every frame of the broker back from the moment the fixture hands it over: publishes reach
    the queues, their confirms never come (a confirm lost: under a memory alarm a publish
    would not land at all)."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": broker_link.url_through(amqp_url)})
    broker = make_broker(settings, graceful_timeout_s=1.0)
    await start_broker(broker, settings)
    broker_link.reply_delay_s = STALLED_S
    try:
        yield broker
    finally:
        # Cut, not healed: frames held back and then let through mid-stop reopened channels
        # (a teardown error, `second 'channel.open' seen`); a cut connection just closes.
        await broker_link.cut()
        await broker.stop()
