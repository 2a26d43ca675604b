"""The webhook DLQ's admin routes on the notifier (`/admin/v1/webhooks/dead-letters`): list,
replay, drop, purge, on the real broker with the whole stack in-process
(`test_notifier.flow`).

A callback whose receiver never answered is given up: recorded failed, its command copied to
`scorebox.webhook-deliveries.dlq`. Before these routes, an operator read and moved that queue
with RabbitMQ's tools only.
"""

from __future__ import annotations

from typing import Any

import aio_pika
import httpx
import pytest

from scorebox import cli
from shared.contracts import new_id
from shared.topology import DLX, WEBHOOK_DELIVERIES
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

    receiver_link.down = False
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
    # Asked again, the letter is gone: nothing is moved back twice.
    again = await flow.notifier.post(
        f"{LETTERS}/replay", json={"ids": [letter["delivery_id"]]}, headers=ADMIN
    )
    assert again.json()["not_found"] == [letter["delivery_id"]]
    await moved_back._all_handled(flow)
    [request] = flow.receiver.requests(url)
    assert request.headers["webhook-id"] == letter["delivery_id"]


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
    await moved_back._all_handled(flow)
    assert flow.receiver.requests(url) == []
    record = await flow.delivery(_id=letter["delivery_id"])
    assert record is not None
    assert record["state"] == "failed"


async def _unreadable_letter(flow: Flow) -> str:
    """A letter that holds no webhook delivery, as a foreign producer could leave."""
    message_id = f"junk-{new_id()}"
    connection = await aio_pika.connect(flow.amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        exchange = await channel.get_exchange(DLX.name, ensure=False)
        await exchange.publish(
            aio_pika.Message(b"not a delivery", message_id=message_id),
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

    replay = await flow.notifier.post(f"{LETTERS}/replay", json={"all": True}, headers=ADMIN)

    assert replay.status_code == 200, replay.text
    assert message_id in replay.json()["skipped_unreadable"]
    listed = [item["message_id"] for item in (await _listing(flow))["items"]]
    assert message_id in listed
    dropped = await flow.notifier.delete(f"{LETTERS}/{message_id}", headers=ADMIN)
    assert dropped.status_code == 200, dropped.text
    assert dropped.json()["removed"] == 1
    assert message_id not in [item["message_id"] for item in (await _listing(flow))["items"]]


async def test_a_purge_empties_the_queue(flow: Flow) -> None:
    await _unreadable_letter(flow)
    await _unreadable_letter(flow)

    response = await flow.notifier.delete(LETTERS, headers=ADMIN)

    assert response.status_code == 200, response.text
    assert response.json()["purged"] >= 2
    assert (await _listing(flow))["count"] == 0


@pytest.mark.parametrize(
    ("method", "path"),
    [("GET", LETTERS), ("POST", f"{LETTERS}/replay"), ("DELETE", LETTERS)],
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
