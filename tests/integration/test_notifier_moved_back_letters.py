"""A webhook's dead letter moved back to its queue once the cause is mended is sent again.

A delivery given up (its receiver never answered) is recorded failed and its command copied
to `scorebox.webhook-deliveries.dlq`. Moved back (a shovel, the management UI's "move
messages": through the default exchange, under the queue's name), the letter found its
record `failed` and was dropped as "already given up": moving a webhook's letter back never
sent it. Now its record is reopened (one conditional update, which one copy of the letter
wins) for a fresh round of attempts; a delivery recorded delivered stays done.

The first tests run the whole stack in-process on the real broker (`test_notifier.flow`),
its receiver reached through a link that is down, then mended; the others run the delivery
handler as a broker hands it a message (two notifier processes at once, too), on the real
database and a real broker: what it sent is read from a queue bound to the delivery commands'
routes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import Any

import aio_pika
import pytest
from prometheus_client.parser import text_string_to_metric_families

from devtools.infra import Endpoint, create_vhost, delete_vhost
from services.notifier.deliveries import RetryPolicy, fresh_round
from services.notifier.ledger import DeliveryRecord, DeliveryState, Ledger
from shared.contracts import DeliverWebhook, new_id, utcnow
from shared.runtime import make_broker, start_broker
from shared.settings import ServiceSettings
from shared.topology import DELAY, ERROR_HEADER, TASKS, WEBHOOK_DELIVERIES
from tests.faults.slow_link import SlowLink
from tests.integration import test_notifier as whole_stack
from tests.integration import test_notifier_delivery_limit as delivery_limit
from tests.integration import test_notifier_own_claims as own_claims
from tests.integration.test_notifier import RECEIVER_HOST, Flow, Receiver, _completed
from tests.integration.test_notifier_delivery_limit import Notifier
from tests.integration.test_notifier_own_claims import Deps, _delivery
from tests.integration.test_projection_dead_letters import move_back
from tests.support import HandedDelivery, eventually

flow = whole_stack.flow  # fixtures
receiver = own_claims.receiver
ledger = own_claims.ledger
make_deps = own_claims.make_deps
Document = dict[str, Any]
GAVE_UP = "gave up after 3 attempt(s); last: receiver.scorebox.test: ClientConnectorError"


# --- The whole stack, on the real broker ------------------------------------------------------


@pytest.fixture
async def receiver_link(flow: Flow) -> AsyncIterator[SlowLink]:
    """The test receiver as reached through a link of this test's own: down (every
    connection closed at once, no answer) until the test mends it."""
    async with SlowLink(("127.0.0.1", flow.receiver.port)).running() as link:
        link.down = True
        yield link


@dataclass(frozen=True)
class GivenUp:
    url: str
    record: Document
    letter: aio_pika.abc.AbstractIncomingMessage


async def _given_up_while_down(flow: Flow, link: SlowLink) -> GivenUp:
    """A callback whose receiver never answered any attempt: recorded failed, in the DLQ."""
    name = flow.receiver.endpoint(200).rsplit("/", 1)[1]
    url = f"https://{RECEIVER_HOST}:{link.port}/hooks/{name}"
    task_id = new_id()
    await flow.publish(_completed(task_id, url))
    record = await flow.settled(task_id, "failed")
    letter = await flow.dead_letter_of(record["_id"])
    assert "gave up after 4 attempt(s)" in str(letter.headers[ERROR_HEADER])
    assert flow.receiver.requests(url) == []
    return GivenUp(url, record, letter)


async def _handled(flow: Flow) -> float:
    """The webhook deliveries the notifier has handled and settled so far (its metrics)."""
    response = await flow.notifier.get("/metrics")
    assert response.status_code == 200, response.text
    return sum(
        sample.value
        for family in text_string_to_metric_families(response.text)
        for sample in family.samples
        if sample.name == "scorebox_deliveries_total"
        and sample.labels.get("queue") == WEBHOOK_DELIVERIES.name
    )


async def _all_handled(flow: Flow, since: float, copies: int) -> None:
    """Wait until the notifier has settled the `copies` deliveries moved back since it had
    handled `since`: each then either sent its POST or dropped it. (Waiting for the queue to
    be empty, and a second more, passed with a second POST that came later: a queue is empty
    once its messages are taken, not handled.)"""

    async def settled() -> bool:
        return await _handled(flow) >= since + copies

    await eventually(settled, what=f"{copies} moved-back deliveries handled")


async def test_a_letter_moved_back_once_its_receiver_is_mended_is_delivered_once(
    flow: Flow, receiver_link: SlowLink
) -> None:
    given_up = await _given_up_while_down(flow, receiver_link)

    receiver_link.down = False
    await move_back(flow.amqp_url, given_up.letter, WEBHOOK_DELIVERIES.name)

    record = await flow.settled(given_up.record["task_id"], "delivered")
    [request] = flow.receiver.requests(given_up.url)
    assert request.headers["webhook-id"] == record["_id"]
    # A fresh round of the 4 attempts, numbered on from the last one given up.
    assert (record["attempt"], record["round_from"]) == (5, 5)


async def test_two_copies_of_a_letter_moved_back_at_once_are_delivered_once(
    flow: Flow, receiver_link: SlowLink
) -> None:
    given_up = await _given_up_while_down(flow, receiver_link)

    receiver_link.down = False
    handled = await _handled(flow)
    await asyncio.gather(
        *(move_back(flow.amqp_url, given_up.letter, WEBHOOK_DELIVERIES.name) for _ in range(2))
    )

    await flow.settled(given_up.record["task_id"], "delivered")
    await _all_handled(flow, handled, copies=2)
    assert len(flow.receiver.requests(given_up.url)) == 1


async def test_a_letter_moved_back_after_its_delivery_succeeded_is_not_sent_again(
    flow: Flow, receiver_link: SlowLink
) -> None:
    given_up = await _given_up_while_down(flow, receiver_link)
    receiver_link.down = False
    await move_back(flow.amqp_url, given_up.letter, WEBHOOK_DELIVERIES.name)
    await flow.settled(given_up.record["task_id"], "delivered")
    handled = await _handled(flow)

    await move_back(flow.amqp_url, given_up.letter, WEBHOOK_DELIVERIES.name)

    await _all_handled(flow, handled, copies=1)
    assert len(flow.receiver.requests(given_up.url)) == 1
    record = await flow.delivery(_id=given_up.record["_id"])
    assert record is not None
    assert (record["state"], record["attempt"]) == ("delivered", 5)


# --- The delivery handler and the ledger, on the real database --------------------------------


@pytest.fixture(scope="module")
def handlers_amqp_url(rabbitmq: Endpoint) -> Iterator[str]:
    """A vhost of the handler tests' own. On the module's, the whole stack's notifier (`flow`,
    up until the module's last test) consumes the webhook deliveries: it would take every
    command these tests' handlers send, and POST and decide on it by itself."""
    vhost = f"scorebox-test-{uuid.uuid4().hex[:10]}"
    url = create_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)
    yield url
    delete_vhost(rabbitmq.url, vhost, management_url=rabbitmq.management_url)


@pytest.fixture
async def notifier(handlers_amqp_url: str) -> AsyncIterator[Notifier]:
    """As `test_notifier_delivery_limit.notifier`, on the handler tests' vhost: the topology
    declared as a service starts (nothing consumes), what the handlers send read from a queue
    bound to the delivery commands' routes."""
    url = handlers_amqp_url
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": url})
    broker = make_broker(settings, name="notifier", graceful_timeout_s=1.0)
    await start_broker(broker, settings)
    try:
        async with delivery_limit._watching_sends(url) as sends:
            yield Notifier(broker, url, sends)
    finally:
        await broker.stop()


def _last_attempt(receiver: Receiver) -> DeliverWebhook:
    return _delivery(receiver).model_copy(update={"attempt": 3, "max_attempts": 3})


async def _given_up(ledger: Ledger, delivery: DeliverWebhook) -> None:
    """Recorded given up at the delivery's attempt and in the DLQ, by a process since gone."""
    await ledger.register(delivery, now=utcnow())
    claim = await ledger.claim(
        delivery, process="proc-z", owner="proc-z/1", now=utcnow(), lease=own_claims.LEASE
    )
    assert claim.won
    assert await ledger.mark_failed(
        delivery, owner="proc-z/1", now=utcnow(), error=GAVE_UP, status=None, dead_letter=True
    )
    await ledger.mark_lettered(delivery, now=utcnow())


def _our_letter(delivery: DeliverWebhook) -> HandedDelivery:
    return HandedDelivery(delivery.model_dump_json().encode(), headers={ERROR_HEADER: GAVE_UP})


def _commands(sent: list[aio_pika.abc.AbstractIncomingMessage]) -> list[DeliverWebhook]:
    return [DeliverWebhook.model_validate_json(message.body) for message in sent]


class ReadTogether(Ledger):
    """The ledger, its first two reads of a record answered together: both copies of the
    letter find it failed before either reopens it."""

    def __init__(self, ledger: Ledger) -> None:  # shares the real one's collection
        self.__dict__.update(ledger.__dict__)
        self.together = asyncio.Barrier(2)
        self.reads = 0

    async def find(self, delivery_id: str) -> DeliveryRecord | None:
        record = await super().find(delivery_id)
        self.reads += 1
        if self.reads <= 2:
            await self.together.wait()
        return record


async def test_two_processes_given_copies_of_a_letter_at_once_post_it_once(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """Both find the record failed; one reopens it, and the other, its update refused,
    replays the recorded first attempt of the new round, which the claim lets one of the
    two processes send."""
    delivery = _last_attempt(receiver[0])
    await _given_up(ledger, delivery)
    shared = ReadTogether(ledger)
    # Each with its own process name and attempts in hand; their publishes on one connection.
    handle_a, handle_b = (
        notifier.handler(replace(make_deps(owner), ledger=shared)) for owner in ("a", "b")
    )
    letters = [_our_letter(delivery), _our_letter(delivery)]

    await asyncio.wait_for(asyncio.gather(handle_a(letters[0]), handle_b(letters[1])), timeout=30)

    assert [letter.settled for letter in letters] == [["ack"], ["ack"]]
    fresh = _commands(await notifier.sent())
    assert {(command.attempt, command.max_attempts) for command in fresh} == {(4, 6)}
    # Each copy of it, to both processes at once.
    await asyncio.wait_for(
        asyncio.gather(
            *(
                handle(HandedDelivery(command.model_dump_json().encode()))
                for command in fresh
                for handle in (handle_a, handle_b)
            )
        ),
        timeout=30,
    )
    assert len(receiver[0].requests(delivery.url)) == 1
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.attempt) == (DeliveryState.DELIVERED, 4)


async def test_of_copies_reopening_a_record_at_once_one_does(
    ledger: Ledger, receiver: tuple[Receiver, Any]
) -> None:
    given_up, forgotten = _last_attempt(receiver[0]), _last_attempt(receiver[0])
    await _given_up(ledger, given_up)
    now = utcnow()

    for letter, reopen in ((given_up, ledger.reopen), (forgotten, ledger.reopen_forgotten)):
        fresh = [fresh_round(letter, round_from=1) for _ in range(3)]
        won = await asyncio.gather(*(reopen(letter, fresh=f, now=now) for f in fresh))

        assert sorted(won) == [False, False, True]
        record = await ledger.find(letter.delivery_id)
        assert record is not None
        assert record.next_delivery == fresh[won.index(True)]
        assert (record.state, record.attempt, record.round_from) == (
            DeliveryState.RETRYING,
            4,
            4,
        )


async def test_a_letter_rabbitmq_made_at_the_delivery_limit_is_tried_again(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """Given up at the limit, its copy to the DLQ refused by the broker: returned as failed,
    RabbitMQ dead-lettered it without the reason (`x-death` from this queue)."""
    delivery = _last_attempt(receiver[0])
    await _given_up(ledger, delivery)
    death = {
        "queue": WEBHOOK_DELIVERIES.name,
        "reason": "delivery_limit",
        "count": 1,
        "exchange": TASKS.name,
        "routing-keys": [DeliverWebhook.routing_key],
    }
    letter = HandedDelivery(
        delivery.model_dump_json().encode(), headers={"x-death": [death], "x-delivery-count": 0}
    )
    handle = notifier.handler(make_deps("a"))

    await asyncio.wait_for(handle(letter), timeout=30)

    [fresh] = _commands(await notifier.sent())
    assert (fresh.attempt, fresh.max_attempts) == (4, 6)
    await asyncio.wait_for(handle(HandedDelivery(fresh.model_dump_json().encode())), timeout=30)
    assert len(receiver[0].requests(delivery.url)) == 1


async def test_a_moved_back_letter_its_receiver_refused_is_not_sent_again(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """RabbitMQ's letter moved back is tried, its receiver refuses it (410: recorded failed,
    never dead-lettered), and the ack is lost: the redelivery, still a moved-back letter by
    its headers, found the record failed at its attempt and opened a fresh round against the
    receiver that had refused it (found in review). It is dropped now, as any copy of a
    delivery its receiver refused."""
    endpoint = receiver[0]
    delivery = _delivery(endpoint).model_copy(update={"url": endpoint.endpoint(410)})
    await ledger.register(delivery, now=utcnow())
    death = {"queue": WEBHOOK_DELIVERIES.name, "reason": "delivery_limit", "count": 1}
    handle = notifier.handler(make_deps("a"))

    for _ in range(2):  # the second: the same message again, its ack lost
        letter = HandedDelivery(delivery.model_dump_json().encode(), headers={"x-death": [death]})
        await asyncio.wait_for(handle(letter), timeout=30)
        assert letter.settled == ["ack"]

    assert notifier.published() == {}
    assert await notifier.letters(delivery) == []
    assert len(endpoint.requests(delivery.url)) == 1
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.dead_letter) == (DeliveryState.FAILED, False)


async def test_a_letter_whose_record_is_gone_is_sent_as_a_fresh_round(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """Past retention the ledger has forgotten the delivery: sent, as a delivery it never saw
    is, with a round of attempts of its own."""
    delivery = _last_attempt(receiver[0])
    handle = notifier.handler(make_deps("a"))

    await asyncio.wait_for(handle(_our_letter(delivery)), timeout=30)

    [sent] = await notifier.sent()
    fresh = DeliverWebhook.model_validate_json(sent.body)
    assert (fresh.attempt, fresh.max_attempts) == (4, 6)
    assert (sent.exchange, fresh.not_before) == (TASKS.name, None)  # sent now
    await asyncio.wait_for(handle(HandedDelivery(fresh.model_dump_json().encode())), timeout=30)
    assert len(receiver[0].requests(delivery.url)) == 1
    record = await ledger.find(delivery.delivery_id)
    assert record is not None
    assert (record.state, record.round_from) == (DeliveryState.DELIVERED, 4)


async def test_a_forgotten_letter_of_a_later_round_gets_one_rounds_attempts(
    make_deps: Deps, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """Where its round began is forgotten with the record: taken as 1, a second round's
    letter (attempts 4 to 6 of rounds of 3) got six attempts, doubling at each such round,
    past the retention the settings are checked against (found in review)."""
    delivery = _delivery(receiver[0]).model_copy(update={"attempt": 6, "max_attempts": 6})
    handle = notifier.handler(replace(make_deps("a"), max_attempts=3))

    await asyncio.wait_for(handle(_our_letter(delivery)), timeout=30)

    [fresh] = _commands(await notifier.sent())
    assert (fresh.attempt, fresh.max_attempts) == (7, 9)


async def test_a_fresh_round_backs_off_from_the_start(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """Numbered on from attempt 4, its first retry waits what a first retry waits (5 to 10 s
    with a 10 s base), not what a fourth one does (40 to 80 s)."""
    failing = receiver[0].endpoint(503)
    delivery = _last_attempt(receiver[0]).model_copy(update={"url": failing})
    await _given_up(ledger, delivery)
    policy = RetryPolicy(base_s=10, cap_s=10_000)
    handle = notifier.handler(replace(make_deps("a"), policy=policy))

    await asyncio.wait_for(handle(_our_letter(delivery)), timeout=30)
    [fresh] = _commands(await notifier.sent())
    before = utcnow()
    await asyncio.wait_for(handle(HandedDelivery(fresh.model_dump_json().encode())), timeout=30)

    [retry] = _commands(await notifier.sent())
    assert retry.attempt == 5
    assert retry.not_before is not None
    assert timedelta(seconds=5) <= retry.not_before - before < timedelta(seconds=11)


async def test_a_moved_back_letter_sent_on_down_the_wait_ladder_is_still_a_letter(
    make_deps: Deps, ledger: Ledger, receiver: tuple[Receiver, Any], notifier: Notifier
) -> None:
    """Not due yet, a moved-back letter goes down the ladder again as a copy; the copy left
    the letter's reason behind, and met by its record given up since, it was dropped as a
    given-up delivery's copy: the move-back came to nothing (found in review)."""
    delivery = _last_attempt(receiver[0]).model_copy(
        update={"not_before": utcnow() + timedelta(minutes=5)}
    )
    await ledger.register(delivery, now=utcnow())
    handle = notifier.handler(make_deps("a"))
    letter = HandedDelivery(delivery.model_dump_json().encode(), headers={ERROR_HEADER: GAVE_UP})

    await asyncio.wait_for(handle(letter), timeout=30)

    assert letter.settled == ["ack"]
    [hop] = await notifier.sent()
    assert hop.exchange == DELAY.name
    assert hop.headers[ERROR_HEADER] == GAVE_UP
    assert DeliverWebhook.model_validate_json(hop.body).attempt == delivery.attempt
