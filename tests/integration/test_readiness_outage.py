"""During an outage `/readyz` answers 503 before a prober gives up.

With the broker away and the database hanging, the gateway's `/readyz` said 503 after
`BROKER_TIMEOUT_S` + `MONGO_TIMEOUT_S` (15 s by default): a probe with a usual timeout saw a
timeout, never the 503, and uvicorn held the service's stop for the abandoned probes. In
process, the gateway reaches the real broker and database through links this test cuts (the
broker) and stalls (the database: connections accepted, replies never passed on). Probes
give up after `PROBE_TIMEOUT_S`, as a prober does: past the readiness deadline, short of the
services' own timeouts (their defaults here)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from services.gateway.app import create_app as create_gateway
from services.gateway.settings import GatewaySettings
from shared.runtime import Check, broker_ready, make_broker
from shared.settings import ServiceSettings
from tests.faults.slow_link import SlowLink
from tests.support import eventually, running

PROBE_TIMEOUT_S = 3.0
HELD_S = 3600.0  # how long the database link holds each reply: for ever, for the test
STALL_S = 5.0  # how long the broker link holds each reply in a stall
SLOW_S = 0.3  # a slow link's delay of each reply: past the readiness deadline in three


async def _probe(api: httpx.AsyncClient) -> httpx.Response:
    """`GET /readyz`, given up after `PROBE_TIMEOUT_S`."""
    try:
        async with asyncio.timeout(PROBE_TIMEOUT_S):
            return await api.get("/readyz")
    except TimeoutError:
        raise AssertionError(f"/readyz did not answer within {PROBE_TIMEOUT_S} s") from None


async def test_readyz_answers_503_within_a_probe_while_the_broker_and_database_are_away(
    amqp_url: str,
    mongo: Any,
    db_prefix: str,
    broker_link: SlowLink,
    database_link: SlowLink,
) -> None:
    env = {
        "RABBITMQ_URL": broker_link.url_through(amqp_url),
        "MONGO_URL": database_link.mongo_url,
        "MONGO_DB_PREFIX": db_prefix,
    }
    gateway = create_gateway(GatewaySettings.model_validate(env))
    async with running(gateway) as api:
        assert (await _probe(api)).status_code == 200
        database_link.reply_delay_s = HELD_S
        await broker_link.cut()

        async def both_seen_away() -> dict[str, bool] | None:
            answer = await _probe(api)
            checks: dict[str, bool] = answer.json()["checks"]
            return checks if answer.status_code == 503 and not any(checks.values()) else None

        checks = await eventually(both_seen_away, what="/readyz saying both are away")
        assert checks == {"rabbitmq": False, "mongodb": False}
        # The gateway stops on a broker and a database that are back.
        broker_link.down, database_link.reply_delay_s = False, 0.0


@contextlib.asynccontextmanager
async def _broker_check(link: SlowLink, amqp_url: str, **env: str) -> AsyncIterator[Check]:
    """The readiness check of a broker connected through `link`; on exit the link is mended
    (up, no delay) and the broker stopped."""
    settings = ServiceSettings.model_validate({"RABBITMQ_URL": link.url_through(amqp_url), **env})
    broker = make_broker(settings)
    await broker.connect()
    try:
        yield broker_ready(broker, settings.broker_timeout_s)
    finally:
        link.down, link.reply_delay_s = False, 0.0
        await broker.stop()


async def test_the_broker_check_answers_within_a_probe_while_its_connection_is_restored(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """FastStream's ping polls a connection being restored until its timeout passes: the
    check waited `BROKER_TIMEOUT_S` (10 s) to say no."""
    async with _broker_check(broker_link, amqp_url) as check:
        assert await check() is True
        await broker_link.cut()

        async def seen_away() -> bool:
            try:
                async with asyncio.timeout(PROBE_TIMEOUT_S):
                    return not await check()
            except TimeoutError:
                raise AssertionError(f"no answer within {PROBE_TIMEOUT_S} s") from None

        await eventually(seen_away, what="the check saying the broker is away")


async def test_the_broker_check_says_no_while_the_link_stalls_and_yes_once_it_answers(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """A stalled link leaves the connection flagged up until the heartbeat gives up (60 s):
    `/readyz` said "rabbitmq: true" through a 150-second stall, every publish timing out (a
    walkthrough). The check is a round trip now: one out past `BROKER_TIMEOUT_S` is a
    stall."""
    async with _broker_check(broker_link, amqp_url, BROKER_TIMEOUT_S="1") as check:
        assert await check() is True
        # Longer than the stall bound, short of the heartbeat; held replies stay held this
        # long once the stall ends, in order.
        broker_link.reply_delay_s = STALL_S

        async def seen_stalled() -> bool:
            return not await check()

        await eventually(seen_stalled, what="the check saying the stalled broker is away")
        broker_link.reply_delay_s = 0.0

        async def seen_back() -> bool:
            return await check()

        await eventually(seen_back, what="the check saying the broker answers again")


async def test_the_broker_check_says_yes_over_a_slow_link(
    amqp_url: str, broker_link: SlowLink
) -> None:
    """A slow link is not a stalled one: cut at the readiness deadline, a probe needing
    three round trips of 0.3 s (the channel's opening and the declare) never passed
    (review)."""
    broker_link.reply_delay_s = SLOW_S
    async with _broker_check(broker_link, amqp_url) as check:
        verdicts = [await check() for _ in range(5)]
    assert verdicts == [True] * 5
