"""Declaring the topology over a long link: its declarations go side by side, so a service
starts over a broker far away within its start-up timeout."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import aiormq
import pytest

from shared import topology
from shared.bus import send_raw
from shared.runtime import DependencyUnreachable, make_broker, start_broker
from shared.settings import ServiceSettings
from shared.topology import (
    EVENTS,
    EXCHANGES,
    RETIRED_QUEUES,
    SCORE_REQUESTS,
    WAIT_TIERS,
    WORK_QUEUES,
    TopologyProbesUnreachable,
    declare_topology,
)
from tests.faults.harness import rabbitmqctl, rabbitmqctl_available, vhost_of
from tests.faults.slow_link import SlowLink
from tests.support import eventually

pytestmark = pytest.mark.integration

# One after another, the declarations took about 130 round trips (`python -m
# tests.faults.topology_starts`): a broker 0.5 s away held the start past the default
# `STARTUP_TIMEOUT_S` (60 s). Side by side, about 36, which this link shows as fewer waits
# (replies of chains in flight together); the bound leaves room for a machine that is busy.
IN_SEQUENCE_AT_LEAST = len(EXCHANGES) + 6 * len(WORK_QUEUES) + 2 * len(WAIT_TIERS)
LONGEST_CHAIN = 60


async def test_the_topology_is_declared_in_a_few_rounds_of_round_trips(amqp_url: str) -> None:
    target = urlsplit(amqp_url)
    link = SlowLink((target.hostname or "127.0.0.1", target.port or 5672), latency_s=0.05)
    async with link.running():
        through = target._replace(netloc=f"{target.netloc.rsplit(':', 1)[0]}:{link.port}")
        settings = ServiceSettings.model_validate({"RABBITMQ_URL": urlunsplit(through)})
        rounds = []
        for _ in ("first start", "a restart: everything there already"):
            broker = make_broker(settings)
            await broker.connect()
            try:
                link.rounds = 0
                await declare_topology(broker)
                rounds.append(link.rounds)
            finally:
                with contextlib.suppress(Exception):
                    await broker.stop()
    assert IN_SEQUENCE_AT_LEAST > LONGEST_CHAIN
    assert all(each <= LONGEST_CHAIN for each in rounds), f"{rounds} waits one after another"


async def test_publishes_after_the_declarations_are_confirmed_and_returned(amqp_url: str) -> None:
    """Every publish goes through the exchange object the declaration left with the broker:
    declared on a channel of its own, without confirms, an unroutable publish was taken as
    sent (the re-read of the change above)."""
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await declare_topology(broker)
        with pytest.raises(aiormq.exceptions.PublishError, match="NO_ROUTE"):
            await send_raw(
                broker,
                b"{}",
                exchange=EVENTS,
                routing_key="nothing.is.bound.to.this",
                timeout=10,
                message_id=None,
                correlation_id=None,
                headers={},
            )
    finally:
        with contextlib.suppress(Exception):
            await broker.stop()


async def test_no_channel_is_opened_beside_a_probe_on_its_connection(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiormq frees the number of a channel the broker closes (the passive declaration of an
    absent retired queue) before its `Close-Ok` is written: a channel opened meanwhile on
    that connection took that number, and the broker closed the whole connection, "second
    'channel.open' seen" (CI, at about one start in thirty, with every declaration side by
    side). The probes go one at a time on a connection of their own."""
    probing: dict[asyncio.Task[Any], Any] = {}
    opened_meanwhile: list[str] = []
    passively_declared = topology._passively_declared
    open_channel = aiormq.Connection.channel

    async def probe(connection: Any, name: str) -> Any:
        task = asyncio.current_task()
        assert task is not None
        probing[task] = connection
        try:
            return await passively_declared(connection, name)
        finally:
            del probing[task]

    async def channel(self: aiormq.Connection, *args: Any, **kwargs: Any) -> Any:
        others = {task: on for task, on in probing.items() if task is not asyncio.current_task()}
        if self in others.values():
            opened_meanwhile.append(repr(asyncio.current_task()))
        return await open_channel(self, *args, **kwargs)

    monkeypatch.setattr(topology, "_passively_declared", probe)
    monkeypatch.setattr(aiormq.Connection, "channel", channel)
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await declare_topology(broker)
    finally:
        with contextlib.suppress(Exception):
            await broker.stop()
    assert opened_meanwhile == []


async def test_the_broker_closes_no_channel_of_the_publishing_connection_while_declaring(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The broker closes the channel of a passive declaration of an absent queue (each
    retired one) and of a DLQ declared with other arguments. aiormq drops the `Close-Ok` it
    owes when its connection's write queue is full, and frees the channel's number all the
    same: the next channel opened under that number closed the whole connection ("second
    'channel.open' seen", CI twice), and the publishing connection is busy with the other
    declarations meanwhile. Those the broker may refuse are made on a connection of their
    own."""
    closed_by_the_broker: list[aiormq.abc.AbstractConnection] = []
    on_close_frame = aiormq.Channel._on_close_frame

    async def seen(channel: aiormq.Channel, frame: aiormq.spec.Channel.Close) -> None:
        closed_by_the_broker.append(channel.connection)
        await on_close_frame(channel, frame)

    monkeypatch.setattr(aiormq.Channel, "_on_close_frame", seen)
    await _declare_an_earlier_versions_dlq(amqp_url)
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await declare_topology(broker)
        default_channel = await broker.config.channel_manager.get_channel()
        publishing = (await default_channel.get_underlay_channel()).connection
    finally:
        await broker.stop()

    assert len(closed_by_the_broker) == 1 + len(RETIRED_QUEUES)  # the DLQ, each absent queue
    assert publishing not in closed_by_the_broker


async def _declare_an_earlier_versions_dlq(amqp_url: str) -> None:
    """The score requests' DLQ as versions before its delivery limit declared it."""
    async with asyncio.timeout(10):
        async with aiormq.connect(amqp_url) as connection:
            channel = await connection.channel()
            dlq = SCORE_REQUESTS.dead_letter_routing_key
            await channel.queue_delete(dlq)  # this module's vhost is shared
            await channel.queue_declare(dlq, durable=True, arguments={"x-queue-type": "quorum"})


async def test_a_probing_connection_the_broker_refuses_is_named(amqp_url: str) -> None:
    """The broker refusing the probing connection (here the vhost's connection limit, which
    the publishing connection reaches) ends the declaration with an error naming it, not a
    bare frame error."""
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    vhost = vhost_of(amqp_url)
    broker = make_broker(ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    await broker.connect()
    try:
        await rabbitmqctl("set_vhost_limits", "-p", vhost, '{"max-connections": 1}')
        try:
            with pytest.raises(TopologyProbesUnreachable, match="topology probes' connection"):
                await declare_topology(broker)
        finally:
            await rabbitmqctl("clear_vhost_limits", "-p", vhost)
    finally:
        with contextlib.suppress(Exception):
            await broker.stop()


async def test_a_start_declares_again_while_the_probing_connection_is_refused(
    amqp_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Refused once (a connection limit reached while old replicas' connections linger, say),
    the start ended at once, where its first connection is waited for: it declares again,
    within its deadline, until the broker takes the probing connection."""
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    vhost = vhost_of(amqp_url)
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url})
    broker = make_broker(settings)
    await rabbitmqctl("set_vhost_limits", "-p", vhost, '{"max-connections": 1}')
    starting = asyncio.ensure_future(start_broker(broker, settings))
    try:
        try:

            async def refused() -> bool:
                assert not starting.done(), starting
                return "declaring the topology failed (TopologyProbesUnreachable" in caplog.text

            await eventually(refused, what="the probing connection refused")
        finally:
            await rabbitmqctl("clear_vhost_limits", "-p", vhost)
        await asyncio.wait_for(starting, 60)
    finally:
        starting.cancel()
        with contextlib.suppress(Exception):
            await broker.stop()


async def test_a_start_refused_its_probing_connection_to_the_end_says_so(amqp_url: str) -> None:
    """Refused to the end, the start ended on "answers too slowly (raise
    STARTUP_TIMEOUT_S)", the wrong advice for a connection limit."""
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    vhost = vhost_of(amqp_url)
    # Its last try at about 6 s: room for a slow one before the caller's own deadline.
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": amqp_url, "STARTUP_TIMEOUT_S": 10})
    broker = make_broker(settings)
    await rabbitmqctl("set_vhost_limits", "-p", vhost, '{"max-connections": 1}')
    try:
        with pytest.raises(DependencyUnreachable, match="topology probes' connection"):
            await start_broker(broker, settings)
    finally:
        await rabbitmqctl("clear_vhost_limits", "-p", vhost)
        with contextlib.suppress(Exception):
            await broker.stop()
