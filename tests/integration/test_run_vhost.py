"""`make run` on the local RabbitMQ with the in-memory MongoDB stand-in works in a vhost of its
own, emptied at its start and deleted at its end: in `/`, a next run inherited the dead
letters and queued tasks of a database that was gone (found in an acceptance run)."""

from __future__ import annotations

import uuid

import aio_pika
import aiormq
import pytest

from devtools.infra import Endpoint, create_vhost, delete_vhost
from devtools.stack import run_vhost, run_vhost_name

pytestmark = pytest.mark.integration


async def _put(url: str, queue: str) -> None:
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True)
        await channel.default_exchange.publish(aio_pika.Message(b"left"), routing_key=queue)


async def _depth(url: str, queue: str) -> int | None:
    """The queue's depth, None when the vhost holds no such queue."""
    connection = await aio_pika.connect(url, timeout=10)
    async with connection:
        channel = await connection.channel()
        try:
            declared = await channel.declare_queue(queue, passive=True)
        except aio_pika.exceptions.ChannelNotFoundEntity:
            return None
        return declared.declaration_result.message_count


async def test_a_run_starts_on_an_empty_vhost_and_leaves_none(rabbitmq: Endpoint) -> None:
    vhost = f"test-run-{uuid.uuid4().hex[:8]}"
    admin = {"management_url": rabbitmq.management_url}
    try:
        left = create_vhost(rabbitmq.url, vhost, **admin)
        await _put(left, "scorebox.score-requests.dlq")  # what a run killed outright left
        with run_vhost(rabbitmq.url, vhost=vhost, **admin) as url:
            assert await _depth(url, "scorebox.score-requests.dlq") is None
            await _put(url, "scorebox.score-requests")
        with pytest.raises(aiormq.exceptions.InvalidFrameError):  # the vhost is gone
            await aio_pika.connect(url, timeout=10)
    finally:
        delete_vhost(rabbitmq.url, vhost, **admin)


def test_a_broker_whose_vhosts_cannot_be_managed_is_used_as_given(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No `rabbitmqctl` for it (not this machine's node) and no management API: `make run`
    died with a traceback (found in review); it runs on the broker as given, and says so."""
    given = "amqp://guest:guest@127.0.0.1:1/"
    with run_vhost(given, vhost="never", management_url="http://127.0.0.1:1") as url:
        assert url == given
    assert "no vhost of its own" in capsys.readouterr().err


def test_two_runs_at_once_have_vhosts_of_their_own() -> None:
    """One name for every run: a second run deleted the first one's vhost, and its queues and
    connections with it (found in review)."""
    assert run_vhost_name(8000) != run_vhost_name(9000)
