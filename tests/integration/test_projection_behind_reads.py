"""A task sent whose outcome is not noted yet is read from the gateway's record however old,
while the status service has not heard of it: with its projection more than
`READ_YOUR_WRITES_WINDOW_S` behind (its queue backed up), the task read 404 "unknown or
expired" and a batch's item `expired`, which told the client to resubmit (a review).

The lag is made by running the status service on a vhost of its own: its reads answer, but
the gateway's commands and events never reach its projection."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from datetime import datetime, timedelta

import httpx
import pytest

from devtools.infra import Endpoint, create_vhost, delete_vhost
from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.contracts import utcnow
from tests.support import queued_commands, running

pytestmark = pytest.mark.integration

API_KEY = generate_key().token
PAST_THE_WINDOW = timedelta(minutes=6)  # READ_YOUR_WRITES_WINDOW_S is 5 minutes


@dataclass
class Clock:
    offset: timedelta = timedelta(0)

    def __call__(self) -> datetime:
        return utcnow() + self.offset


@dataclass
class Stack:
    api: httpx.AsyncClient
    amqp_url: str
    clock: Clock


@pytest.fixture(scope="module")
def elsewhere(rabbitmq: Endpoint) -> Iterator[str]:
    """A vhost the status service alone uses: it hears nothing the gateway sends."""
    vhost = f"scorebox-test-elsewhere-{uuid.uuid4().hex[:8]}"
    yield create_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    delete_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)


@pytest.fixture(scope="module")
async def stack(
    amqp_url: str, elsewhere: str, mongo: Endpoint, db_prefix: str
) -> AsyncIterator[Stack]:
    env = {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "BOOTSTRAP_API_KEY": API_KEY,
        "RATE_LIMIT_PER_MIN": "0",
        "READ_YOUR_WRITES_WINDOW_S": "300",
    }
    clock = Clock()
    status_settings = StatusSettings.model_validate({**env, "RABBITMQ_URL": elsewhere})
    async with running(create_status(status_settings)) as status:
        gateway = create_gateway(
            GatewaySettings.model_validate(env), status_http=status, clock=clock
        )
        async with running(gateway) as api:
            api.headers["Authorization"] = f"Bearer {API_KEY}"
            yield Stack(api, amqp_url, clock)


@pytest.fixture
def later(stack: Stack) -> Iterator[Stack]:
    yield stack
    stack.clock.offset = timedelta(0)


async def test_a_task_sent_and_not_finished_reads_queued_past_the_window(later: Stack) -> None:
    accepted = await later.api.post("/v1/scores", json={"text": "An essay.", "use_cache": False})
    assert accepted.status_code == 202, accepted.text
    task_id = accepted.json()["task_id"]

    later.clock.offset = PAST_THE_WINDOW
    read = await later.api.get(f"/v1/scores/{task_id}")

    assert read.status_code == 200, read.text
    assert read.json()["status"] == "queued"
    assert task_id in {command.task_id for command in await queued_commands(later.amqp_url)}


async def test_a_batch_item_sent_and_not_finished_reads_queued_past_the_window(
    later: Stack,
) -> None:
    made = await later.api.post("/v1/batches", json={"items": [{"text": "An essay."}]})
    assert made.status_code == 202, made.text
    batch_id = made.json()["batch_id"]

    later.clock.offset = PAST_THE_WINDOW
    page = await later.api.get(f"/v1/batches/{batch_id}")

    assert page.status_code == 200, page.text
    assert page.json()["items"][0]["status"] == "queued"
    assert {state: n for state, n in page.json()["counts"].items() if n} == {"queued": 1}
    await queued_commands(later.amqp_url)
