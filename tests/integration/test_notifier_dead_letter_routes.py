"""The webhook DLQ's admin routes on the notifier (`/admin/v1/webhooks/dead-letters`): list,
show, replay, drop, purge, on the real broker with the whole stack in-process
(`test_notifier.flow`).

A callback whose receiver never answered is given up: recorded failed, its command copied to
`scorebox.webhook-deliveries.dlq`. Before these routes, an operator read and moved that queue
with RabbitMQ's tools only.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import aio_pika
import httpx
import pytest
from aio_pika.abc import AbstractIncomingMessage
from faststream.rabbit import RabbitBroker

from scorebox import cli
from services.notifier.dead_letters import WebhookDeadLetters
from services.notifier.settings import NotifierSettings
from shared.contracts import DeliverWebhook, WebhookPurpose, new_id, utcnow
from shared.dead_letters import DeadLetterWalker
from shared.runtime import make_broker
from shared.topology import DLX, ERROR_HEADER, WEBHOOK_DELIVERIES
from tests.faults.slow_link import SlowLink
from tests.integration import test_notifier as whole_stack
from tests.integration import test_notifier_moved_back_letters as moved_back
from tests.integration.test_notifier import ADMIN_KEY, RECEIVER_HOST, Flow, _completed
from tests.support import eventually

flow = whole_stack.flow  # fixtures
receiver_link = moved_back.receiver_link
LETTERS = "/admin/v1/webhooks/dead-letters"
ADMIN = {"Authorization": f"Bearer {ADMIN_KEY}"}
Json = dict[str, Any]


async def _listing(flow: Flow) -> Json:
    response = await flow.notifier.get(LETTERS, headers=ADMIN)
    assert response.status_code == 200, response.text
    listing: Json = response.json()
    return listing


async def _letters_of(flow: Flow, delivery_id: str) -> list[Json]:
    return [item for item in (await _listing(flow))["items"] if item["delivery_id"] == delivery_id]


async def _given_up(flow: Flow, link: SlowLink) -> tuple[str, Json]:
    """A callback given up while its receiver's link was down, as the listing shows it: its
    URL (without the query the receiver's records are read by, `Receiver.requests`) and its
    letter."""
    name = flow.receiver.endpoint(200).rsplit("/", 1)[1]
    url = f"https://{RECEIVER_HOST}:{link.port}/hooks/{name}?token=secret"
    task_id = new_id()
    await flow.publish(_completed(task_id, url))
    record = await flow.settled(task_id, "failed")

    async def listed() -> Json | None:
        letters = await _letters_of(flow, record["_id"])
        return letters[0] if letters else None

    letter = await eventually(listed, what="the given-up webhook listed")
    assert letter["task_id"] == task_id
    # Shown without its query: a token in a callback URL is the tenant's secret.
    bare = url.split("?", 1)[0]
    assert letter["url"] == bare
    return bare, letter


async def test_a_webhook_given_up_is_listed_then_replayed_and_delivered_once(
    flow: Flow, receiver_link: SlowLink
) -> None:
    url, letter = await _given_up(flow, receiver_link)
    assert letter["purpose"] == "callback"
    assert letter["event_type"] == "task.completed"
    assert letter["attempt"] == letter["max_attempts"] == 4
    assert "gave up after 4 attempt(s)" in letter["reason"]
    assert flow.receiver.requests(url) == []
    shown = await flow.notifier.get(f"{LETTERS}/{letter['delivery_id']}", headers=ADMIN)
    assert shown.status_code == 200, shown.text
    assert shown.json()["body"]["data"]["task_id"] == letter["task_id"]  # what it POSTs
    assert shown.json()["url"] == letter["url"]  # not the command's, with its query

    receiver_link.down = False
    handled = await moved_back._handled(flow)
    response = await flow.notifier.post(
        f"{LETTERS}/replay", json={"ids": [letter["delivery_id"]]}, headers=ADMIN
    )

    assert response.status_code == 200, response.text
    report = response.json()
    assert [moved["delivery_id"] for moved in report["replayed"]] == [letter["delivery_id"]]
    assert report["not_found"] == report["not_reached"] == report["skipped_unreadable"] == []
    record = await flow.settled(letter["task_id"], "delivered")
    assert record["_id"] == letter["delivery_id"]
    assert await _letters_of(flow, letter["delivery_id"]) == []
    gone = await flow.notifier.get(f"{LETTERS}/{letter['delivery_id']}", headers=ADMIN)
    assert gone.status_code == 404, gone.text
    # Asked again, the letter is gone: nothing is moved back twice.
    again = await flow.notifier.post(
        f"{LETTERS}/replay", json={"ids": [letter["delivery_id"]]}, headers=ADMIN
    )
    assert again.json()["not_found"] == [letter["delivery_id"]]
    await moved_back._all_handled(flow, handled, copies=1)
    [request] = flow.receiver.requests(url)
    assert request.headers["webhook-id"] == letter["delivery_id"]


async def test_a_replayed_webhook_given_up_again_names_the_attempts_of_its_round(
    flow: Flow, receiver_link: SlowLink
) -> None:
    """Attempts are numbered on across rounds: "gave up after 8 attempt(s)" alone, with
    `WEBHOOK_MAX_ATTEMPTS` 4, read as the setting ignored (a walkthrough)."""
    _, letter = await _given_up(flow, receiver_link)

    response = await flow.notifier.post(
        f"{LETTERS}/replay", json={"ids": [letter["delivery_id"]]}, headers=ADMIN
    )
    assert response.status_code == 200, response.text

    async def given_up_again() -> Json | None:
        letters = await _letters_of(flow, letter["delivery_id"])
        return letters[0] if letters and letters[0]["attempt"] == 8 else None

    again = await eventually(given_up_again, what="the fresh round given up too")
    assert again["max_attempts"] == 8
    assert "gave up after 8 attempt(s), 4 since its dead letter was moved back" in again["reason"]


async def test_a_dropped_letter_leaves_the_queue_and_its_webhook_is_not_sent(
    flow: Flow, receiver_link: SlowLink
) -> None:
    url, letter = await _given_up(flow, receiver_link)
    receiver_link.down = False

    response = await flow.notifier.delete(f"{LETTERS}/{letter['delivery_id']}", headers=ADMIN)

    assert response.status_code == 200, response.text
    assert response.json() == {
        "letter_id": letter["delivery_id"],
        "removed": 1,
        "truncated": False,
    }
    assert await _letters_of(flow, letter["delivery_id"]) == []
    again = await flow.notifier.delete(f"{LETTERS}/{letter['delivery_id']}", headers=ADMIN)
    assert again.status_code == 404, again.text
    assert flow.receiver.requests(url) == []  # the letter left the DLQ for no queue
    record = await flow.delivery(_id=letter["delivery_id"])
    assert record is not None
    assert record["state"] == "failed"


async def _unreadable_letter(
    flow: Flow, body: bytes = b"not a delivery", message_id: str | None = None
) -> str:
    """A letter that holds no webhook delivery, as a foreign producer could leave."""
    message_id = message_id or f"junk-{new_id()}"
    connection = await aio_pika.connect(flow.amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(DLX.name, ensure=False)
        await exchange.publish(
            aio_pika.Message(body, message_id=message_id),
            routing_key=WEBHOOK_DELIVERIES.dead_letter_routing_key,
            timeout=10,
        )
    return message_id


async def test_an_unreadable_letter_is_kept_by_a_replay_and_dropped_by_its_message_id(
    flow: Flow,
) -> None:
    message_id = await _unreadable_letter(flow)
    [shown] = [item for item in (await _listing(flow))["items"] if item["message_id"] == message_id]
    assert shown["delivery_id"] is None
    whole = await flow.notifier.get(f"{LETTERS}/{message_id}", headers=ADMIN)
    assert whole.status_code == 200, whole.text
    assert whole.json()["body"] == "not a delivery"

    replay = await flow.notifier.post(f"{LETTERS}/replay", json={"all": True}, headers=ADMIN)

    assert replay.status_code == 200, replay.text
    assert message_id in replay.json()["skipped_unreadable"]
    listed = [item["message_id"] for item in (await _listing(flow))["items"]]
    assert message_id in listed
    dropped = await flow.notifier.delete(f"{LETTERS}/{message_id}", headers=ADMIN)
    assert dropped.status_code == 200, dropped.text
    assert dropped.json()["removed"] == 1
    assert message_id not in [item["message_id"] for item in (await _listing(flow))["items"]]


async def test_a_letter_of_another_build_is_shown_without_its_urls_query(flow: Flow) -> None:
    """A command this build cannot read (a purpose it does not know) is shown whole, but its
    URL as the listing shows it: the query carries the tenant's token."""
    message_id = f"future-{new_id()}"
    command = {
        "delivery_id": f"msg_{new_id()}",
        "task_id": new_id(),
        "purpose": "a-purpose-of-a-later-build",
        "url": "https://u:pw@hooks.example/in?token=secret",
        "event_type": "task.completed",
        "payload": {},
    }
    await _unreadable_letter(flow, json.dumps(command).encode(), message_id)

    shown = await flow.notifier.get(f"{LETTERS}/{message_id}", headers=ADMIN)

    assert shown.status_code == 200, shown.text
    assert shown.json()["body"]["url"] == "https://hooks.example/in"
    assert "secret" not in shown.text
    assert "u:pw@" not in shown.text


async def test_a_purge_empties_the_queue(flow: Flow) -> None:
    await _unreadable_letter(flow)
    await _unreadable_letter(flow)

    response = await flow.notifier.delete(LETTERS, headers=ADMIN)

    assert response.status_code == 200, response.text
    assert response.json()["purged"] >= 2
    assert (await _listing(flow))["count"] == 0


async def test_a_drop_with_an_empty_id_never_reaches_the_purge(flow: Flow) -> None:
    """`DELETE .../dead-letters/` (a script's drop of an empty id) was redirected (307) to
    the purge, and a client following redirects keeps the method and the key: every
    webhook dead letter was deleted (review of the notifier)."""
    await _unreadable_letter(flow)
    before = (await _listing(flow))["count"]

    answer = await flow.notifier.delete(f"{LETTERS}/", headers=ADMIN, follow_redirects=True)

    assert answer.status_code in (404, 405), answer.text
    assert answer.history == []
    assert (await _listing(flow))["count"] == before


@pytest.mark.parametrize(
    ("method", "path"),
    [
        ("GET", LETTERS),
        ("GET", f"{LETTERS}/msg_1"),
        ("POST", f"{LETTERS}/replay"),
        ("DELETE", f"{LETTERS}/msg_1"),
        ("DELETE", LETTERS),
    ],
)
async def test_the_routes_take_the_admin_key_alone(flow: Flow, method: str, path: str) -> None:
    """The internal routes' callers (the gateway) hold no admin key; nor does a tenant."""
    for headers in ({}, {"Authorization": "Bearer not-the-admin-key"}):
        response = await flow.notifier.request(method, path, headers=headers, json={"all": True})
        assert response.status_code == 401, response.text
        assert response.headers["content-type"] == "application/problem+json"


def test_the_cli_and_the_routes_name_the_same_path() -> None:
    assert cli.WEBHOOK_DEAD_LETTERS == LETTERS
    assert WEBHOOK_DELIVERIES.dead_letter_routing_key == cli.WEBHOOK_DELIVERIES_DLQ
    assert httpx.URL(cli.DEFAULT_NOTIFIER_URL).port == 8004


# --- A replay the broker fails, its letters put in the DLQ as the notifier puts them --------


class SendsFailing(WebhookDeadLetters):
    """The routes' replay over the real walker and broker, its moves back failing from the
    `fail_from`-th on, as a broker gone away fails them."""

    def __init__(self, broker: RabbitBroker, *, fail_from: int) -> None:
        walker = DeadLetterWalker(broker, WEBHOOK_DELIVERIES, timeout_s=10)
        super().__init__(walker, broker, clock=utcnow, timeout_s=10)
        self.fail_from, self.sent = fail_from, 0

    async def _send_back(self, message: AbstractIncomingMessage) -> None:
        if self.sent >= self.fail_from:
            raise ConnectionError("the broker went away")
        self.sent += 1
        await super()._send_back(message)


@contextlib.asynccontextmanager
async def _broker(flow: Flow) -> AsyncIterator[RabbitBroker]:
    broker = make_broker(NotifierSettings.model_validate({"RABBITMQ_URL": flow.amqp_url}))
    async with broker:
        await broker.connect()
        yield broker


async def _given_up_letter(flow: Flow) -> str:
    """A delivery's letter as the notifier leaves one given up (its reason in our header); the
    delivery's id. Its URL answers 200 once moved back."""
    delivery = DeliverWebhook(
        task_id=new_id(),
        delivery_id=f"msg_{new_id()}",
        purpose=WebhookPurpose.CALLBACK,
        url=flow.receiver.endpoint(200),
        event_type="task.completed",
        payload={"type": "task.completed"},
        attempt=4,
        max_attempts=4,
    )
    connection = await aio_pika.connect(flow.amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(DLX.name, ensure=False)
        letter = aio_pika.Message(
            delivery.model_dump_json().encode(),
            message_id=delivery.message_id,
            headers={ERROR_HEADER: "gave up after 4 attempt(s)"},
        )
        await exchange.publish(
            letter, routing_key=WEBHOOK_DELIVERIES.dead_letter_routing_key, timeout=10
        )
    return delivery.delivery_id


async def test_a_replay_the_broker_fails_at_once_answers_with_the_error_and_keeps_the_letter(
    flow: Flow,
) -> None:
    """A letter is acked only once its move back was confirmed: failing first, nothing left
    the DLQ, and the route's 503 (`BROKER_ERRORS`) says to try again."""
    delivery_id = await _given_up_letter(flow)

    async with _broker(flow) as broker:
        with pytest.raises(ConnectionError):
            await SendsFailing(broker, fail_from=0).replay([delivery_id])

    assert len(await _letters_of(flow, delivery_id)) == 1


async def test_a_replay_the_broker_fails_part_way_reports_what_it_moved_and_keeps_the_rest(
    flow: Flow,
) -> None:
    first, second = await _given_up_letter(flow), await _given_up_letter(flow)

    async with _broker(flow) as broker:
        replay = await SendsFailing(broker, fail_from=1).replay([first, second])

    assert [moved.delivery_id for moved in replay.replayed] == [first]
    assert replay.interrupted == "The message broker is unavailable; try again shortly."
    assert (replay.not_reached, replay.not_found, replay.timed_out) == ([second], [], False)
    assert await _letters_of(flow, first) == []
    assert len(await _letters_of(flow, second)) == 1


async def test_a_get_of_the_replay_route_is_a_405_not_a_letter_looked_for(flow: Flow) -> None:
    """As on the gateway: `GET .../replay` is the replay's path, not a letter's id."""
    answer = await flow.notifier.get(f"{LETTERS}/replay", headers=ADMIN)

    assert answer.status_code == 405, answer.text
    assert answer.headers["allow"] == "POST"
    assert answer.headers["content-type"].startswith("application/problem+json")
