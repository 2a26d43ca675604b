"""A dead-letter walk leaves nothing held once it is over, and says it stopped short of the
queue's end only when letters are left, on the real broker.

A walk returned what it held one letter at a time and gave up at the first return that
failed: on a channel that stayed open (the broker's own, shared with its publishers) the
letters after it stayed unacknowledged until that channel closed, out of every later walk's
sight (a drop answered 404, a replay `not_found`). So did a letter whose `basic.get` answer
came after the walk had given up on it. A walk now holds its letters on a channel of its
own, closed when it ends, and the broker takes back whatever that channel still held.

A walk whose bound (here its byte budget) was reached by the queue's last letter said it was
cut short though nothing was left behind it; it now looks one letter further first.

Failures are made in the client (a return or a get that fails for one letter), never on the
broker, which other tests share; what they leave behind is awaited by polling."""

from __future__ import annotations

from collections.abc import AsyncIterator

import aio_pika
import pytest
from aio_pika.queue import Queue
from faststream.rabbit import RabbitBroker

from services.scheduler.messaging import SchedulerBus
from shared.contracts import ScoreText, new_id, utcnow
from shared.dead_letters import DeadLetterWalker
from shared.topology import SCORE_REQUESTS, declare_topology
from tests.support import drain, eventually

DLQ = SCORE_REQUESTS.dead_letter_routing_key
TIMEOUT_S = 5.0


@pytest.fixture(scope="module")
async def broker(amqp_url: str) -> AsyncIterator[RabbitBroker]:
    broker = RabbitBroker(amqp_url)
    await broker.connect()
    await declare_topology(broker)
    yield broker
    await broker.stop()


@pytest.fixture
async def dlq(amqp_url: str, broker: RabbitBroker) -> str:
    """The score requests' DLQ, emptied for the test; the vhost's URL."""
    await _drain(amqp_url)
    return amqp_url


async def _drain(amqp_url: str) -> list[str | None]:
    """The message ids of every letter of the DLQ, taken off it in the queue's order."""
    return [message.message_id for message in await drain(amqp_url, DLQ)]


# Every letter's body (told apart by their message ids): a walk's byte budget is counted in it.
BODY = ScoreText(task_id=new_id(), text="A letter " + "x" * 500).model_dump_json().encode()


async def _dead_letter(amqp_url: str, count: int) -> list[str]:
    """`count` letters of one size in the DLQ, in order; their message ids."""
    ids = [new_id() for _ in range(count)]
    async with await aio_pika.connect(amqp_url, timeout=10) as connection:
        channel = await connection.channel(publisher_confirms=True)
        for message_id in ids:
            message = aio_pika.Message(BODY, message_id=message_id)
            await channel.default_exchange.publish(message, routing_key=DLQ, timeout=10)
    return ids


async def _all_back(walker: DeadLetterWalker, ids: list[str]) -> None:
    """Wait until a walk sees every letter of `ids` again (polling, with a deadline)."""

    async def seen() -> list[str | None] | None:
        async with walker.walk() as held:
            found = [message.message_id for message in held]
        return found if sorted(found, key=str) == sorted(ids) else None

    await eventually(seen, timeout_s=15, what=f"every letter back in sight ({len(ids)})")


async def test_a_return_that_fails_leaves_no_letter_held(
    dlq: str, broker: RabbitBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The return of the second of three letters fails (as it times out on a stalled
    channel that stays open): neither it nor the third stays out of sight."""
    ids = await _dead_letter(dlq, 3)
    walker = DeadLetterWalker(broker, SCORE_REQUESTS, timeout_s=TIMEOUT_S)
    nack = aio_pika.IncomingMessage.nack

    async def fails_for_the_second(
        message: aio_pika.IncomingMessage, multiple: bool = False, requeue: bool = True
    ) -> None:
        if message.message_id == ids[1]:
            raise TimeoutError("the return of this letter timed out")
        await nack(message, multiple=multiple, requeue=requeue)

    with monkeypatch.context() as patched:
        patched.setattr(aio_pika.IncomingMessage, "nack", fails_for_the_second)
        async with walker.walk() as held:
            assert [message.message_id for message in held] == ids

    await _all_back(walker, ids)
    assert sorted(await _drain(dlq), key=str) == sorted(ids)


async def test_a_letter_whose_get_answer_came_too_late_is_not_left_held(
    dlq: str, broker: RabbitBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The second `basic.get` of a walk takes a letter but its answer comes after the walk
    gave up waiting (a `TimeoutError`): the walk fails, and that letter, which it never saw,
    is not left held."""
    ids = await _dead_letter(dlq, 3)
    walker = DeadLetterWalker(broker, SCORE_REQUESTS, timeout_s=TIMEOUT_S)
    get = Queue.get
    gets = 0

    async def second_answer_too_late(
        queue: Queue, *, no_ack: bool = False, fail: bool = True, timeout: float | None = 5
    ) -> aio_pika.IncomingMessage | None:
        nonlocal gets
        assert not fail  # as a walk asks
        message = await get(queue, no_ack=no_ack, fail=False, timeout=timeout)
        gets += 1
        if gets == 2:
            raise TimeoutError("the answer to basic.get came too late")
        return message

    with monkeypatch.context() as patched:
        patched.setattr(Queue, "get", second_answer_too_late)
        with pytest.raises(TimeoutError):
            async with walker.walk():
                pass

    await _all_back(walker, ids)
    assert sorted(await _drain(dlq), key=str) == sorted(ids)


async def test_a_walk_whose_bound_the_last_letter_reached_is_not_truncated(
    dlq: str, broker: RabbitBroker
) -> None:
    (only,) = await _dead_letter(dlq, 1)
    walker = DeadLetterWalker(broker, SCORE_REQUESTS, timeout_s=TIMEOUT_S, max_bytes=len(BODY))

    async with walker.walk() as held:
        assert ([message.message_id for message in held], held.truncated) == ([only], False)

    assert await _drain(dlq) == [only]


async def test_a_walk_bound_with_letters_past_it_is_truncated_and_keeps_their_order(
    dlq: str, broker: RabbitBroker
) -> None:
    """The letter looked at past the bound is not among those held, and goes back behind
    them: the queue keeps its order."""
    ids = await _dead_letter(dlq, 3)
    walker = DeadLetterWalker(broker, SCORE_REQUESTS, timeout_s=TIMEOUT_S, max_bytes=len(BODY))

    async with walker.walk() as held:
        assert ([message.message_id for message in held], held.truncated) == ([ids[0]], True)
        assert held.bytes_held == len(BODY)

    assert await _drain(dlq) == ids


async def test_a_depth_probe_whose_return_fails_leaves_no_letter_held(
    dlq: str, broker: RabbitBroker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Housekeeping's look at a DLQ's head (`SchedulerBus.dead_letter_depth`) held it on the
    broker's shared channel: when its return failed, the head stayed out of every walk's
    sight until that channel closed."""
    ids = await _dead_letter(dlq, 2)
    bus = SchedulerBus(broker, timeout_s=TIMEOUT_S, clock=utcnow)
    returned: list[str | None] = []

    async def fails(
        message: aio_pika.IncomingMessage, multiple: bool = False, requeue: bool = True
    ) -> None:
        returned.append(message.message_id)
        raise TimeoutError("the return of the head timed out")

    with monkeypatch.context() as patched:
        patched.setattr(aio_pika.IncomingMessage, "nack", fails)
        depth, _ = await bus.dead_letter_depth(SCORE_REQUESTS)

    assert (depth, returned) == (2, ids[:1])
    await _all_back(DeadLetterWalker(broker, SCORE_REQUESTS, timeout_s=TIMEOUT_S), ids)
