"""The notifier reaches `devtools.webhook_receiver` by its name, as `WEBHOOKS=local make run`
sets it up: the receiver runs as a process (a throwaway CA, a certificate for
`receiver.scorebox.test`, on 127.0.0.1), and the notifier, in-process on the real broker and
database, gets the settings the receiver announces: the CA, the name exempt from the address
check and `WEBHOOK_TEST_HOST_ADDRESSES` mapping it to 127.0.0.1. No resolver is handed in:
the name is answered by the mapping, in front of the notifier's own DNS resolver (which
knows no such name), and the connection checks SNI and the certificate for it.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from pymongo import AsyncMongoClient

from services.notifier.app import create_app as create_notifier
from services.notifier.consumer import send_delivery
from services.notifier.keyring import Keyring
from services.notifier.settings import NotifierSettings
from shared.contracts import DeliverWebhook, WebhookPurpose, new_id, utcnow
from shared.runtime import make_broker
from tests.support import eventually, running
from tests.support_sync import LineCollector, read_line_within

Document = dict[str, Any]
TENANT = "default"


@dataclass
class ReceiverProcess:
    url: str
    notifier_env: dict[str, str]
    output: LineCollector


@dataclass
class Setup:
    settings: NotifierSettings
    deliveries: Any
    receivers: dict[str, ReceiverProcess]


@pytest.fixture(scope="module")
async def secret(mongo: Any, db_prefix: str) -> AsyncIterator[str]:
    """The default tenant's signing secret, made as its first webhook would make it."""
    client: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        keyring = Keyring(client, f"{db_prefix}_notifier")
        yield (await keyring.current(TENANT, now=utcnow())).secret
    finally:
        await client.close()


def _start_receiver(*args: str) -> tuple[subprocess.Popen[bytes], ReceiverProcess]:
    process = subprocess.Popen(
        [sys.executable, "-m", "devtools.webhook_receiver", "--exit-with-parent", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    announcement = json.loads(read_line_within(process, timeout_s=30))
    return process, ReceiverProcess(
        announcement["url"], announcement["notifier_env"], LineCollector(process)
    )


@pytest.fixture(scope="module")
def receivers(secret: str) -> Iterator[dict[str, ReceiverProcess]]:
    """Two receivers of one name (two ports, two CAs): one answers 200, one 500 first."""
    started: list[subprocess.Popen[bytes]] = []
    try:
        found: dict[str, ReceiverProcess] = {}
        for role, args in (("ok", ()), ("fail-once", ("--fail", "1"))):
            process, receiver = _start_receiver("--secret", secret, *args)
            started.append(process)
            found[role] = receiver
        yield found
    finally:
        for process in started:
            process.terminate()
            process.wait(timeout=10)
            if process.stdout is not None:
                process.stdout.close()


@pytest.fixture(scope="module")
async def setup(
    amqp_url: str, mongo: Any, db_prefix: str, receivers: dict[str, ReceiverProcess]
) -> AsyncIterator[Setup]:
    ok, fail_once = receivers["ok"], receivers["fail-once"]
    ca_bundle = f"{ok.notifier_env['WEBHOOK_CA_FILE']}.bundle.pem"
    with open(ca_bundle, "w", encoding="utf-8") as bundle:  # noqa: ASYNC230 - a test's setup
        for receiver in (ok, fail_once):
            with open(receiver.notifier_env["WEBHOOK_CA_FILE"], encoding="utf-8") as ca:  # noqa: ASYNC230
                bundle.write(ca.read())
    settings = NotifierSettings.model_validate(
        {
            "RABBITMQ_URL": amqp_url,
            "MONGO_URL": mongo.url,
            "MONGO_DB_PREFIX": db_prefix,
            **ok.notifier_env,  # the name and its address are the same for both
            "WEBHOOK_CA_FILE": ca_bundle,
            "WEBHOOK_RETRY_BASE_S": "0.01",  # a retry goes out at once
        }
    )
    database: AsyncMongoClient[Document] = AsyncMongoClient(mongo.url, tz_aware=True)
    try:
        async with running(create_notifier(settings)):
            yield Setup(settings, database[f"{db_prefix}_notifier"]["deliveries"], receivers)
    finally:
        await database.close()


async def _send(setup: Setup, url: str) -> DeliverWebhook:
    task_id = new_id()
    command = DeliverWebhook(
        task_id=task_id,
        delivery_id=f"msg_{uuid.uuid4().hex}",
        purpose=WebhookPurpose.CALLBACK,
        url=url,
        event_type="task.completed",
        payload={
            "type": "task.completed",
            "data": {"task_id": task_id, "status": "completed", "purpose": "callback"},
        },
    )
    broker = make_broker(setup.settings)
    async with broker:
        await broker.connect()
        await send_delivery(broker, command, now=utcnow(), timeout=10)
    return command


async def _line_about(receiver: ReceiverProcess, command: DeliverWebhook, count: int) -> list[str]:
    async def lines() -> list[str] | None:
        found = [line for line in receiver.output.lines if command.delivery_id in line]
        return found if len(found) >= count else None

    return await eventually(lines, what=f"{count} deliveries of {command.delivery_id} reported")


async def _delivered(setup: Setup, command: DeliverWebhook) -> Document:
    async def record() -> Document | None:
        found: Document | None = await setup.deliveries.find_one(
            {"_id": command.delivery_id, "state": "delivered"}
        )
        return found

    return await eventually(record, what=f"{command.delivery_id} delivered")


async def test_the_notifier_reaches_the_receiver_by_name_and_its_signature_checks(
    setup: Setup,
) -> None:
    receiver = setup.receivers["ok"]
    assert receiver.url.startswith("https://receiver.scorebox.test:")
    command = await _send(setup, receiver.url)

    [line] = await _line_about(receiver, command, 1)

    assert f"task.completed task={command.task_id} status=completed purpose=callback" in line
    assert "(try 1)" in line
    assert "signature ok; answered 200" in line
    record = await _delivered(setup, command)
    assert record["attempt"] == 1


async def test_a_receiver_told_to_fail_sees_the_retry(setup: Setup) -> None:
    receiver = setup.receivers["fail-once"]
    command = await _send(setup, receiver.url)

    first, second = await _line_about(receiver, command, 2)

    assert "(try 1)" in first
    assert "signature ok; answered 500 (--fail 1)" in first
    assert "(try 2)" in second
    assert "signature ok; answered 200" in second
    record = await _delivered(setup, command)
    assert record["attempt"] == 2
