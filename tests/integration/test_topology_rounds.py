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
from shared.runtime import make_broker
from shared.settings import ServiceSettings
from shared.topology import EVENTS, EXCHANGES, WAIT_TIERS, WORK_QUEUES, declare_topology
from tests.faults.slow_link import SlowLink

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


async def test_no_channel_is_opened_while_the_broker_may_be_closing_one(
    amqp_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """aiormq frees the number of a channel the broker closes (the passive declaration of an
    absent retired queue) before its `Close-Ok` is written: a channel opened meanwhile took
    that number, and the broker closed the whole connection, "second 'channel.open' seen"
    (CI, at about one start in thirty, with every declaration side by side)."""
    probing: set[asyncio.Task[Any]] = set()
    opened_meanwhile: list[str] = []
    passively_declared = topology._passively_declared
    open_channel = aiormq.Connection.channel

    async def probe(connection: Any, name: str) -> Any:
        task = asyncio.current_task()
        assert task is not None
        probing.add(task)
        try:
            return await passively_declared(connection, name)
        finally:
            probing.discard(task)

    async def channel(self: aiormq.Connection, *args: Any, **kwargs: Any) -> Any:
        if probing - {asyncio.current_task()}:
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
