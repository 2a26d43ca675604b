"""The dead-letter admin routes answer 503 while the broker connection is being restored.

They hung: aio-pika's robust channel waits without end for a lost connection to come back
before a `basic.get`, its own `timeout` covering only the round trip. In process, the
gateway reaching the real broker through `SlowLink`, which this test cuts; 60 s here only
stops a hang."""

from __future__ import annotations

import asyncio
from typing import Any

from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from shared.http import PROBLEM_JSON
from tests.faults.slow_link import SlowLink
from tests.support import eventually, running

ADMIN = {"Authorization": "Bearer test-admin-key"}


async def test_dead_letter_routes_answer_503_while_the_broker_is_away(
    amqp_url: str, mongo: Any, db_prefix: str, broker_link: SlowLink
) -> None:
    link = broker_link
    env = {
        "RABBITMQ_URL": link.url_through(amqp_url),
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "ADMIN_API_KEY": "test-admin-key",
        "BOOTSTRAP_API_KEY": generate_key().token,
        "BROKER_TIMEOUT_S": "1",
    }
    gateway = create_gateway(GatewaySettings.model_validate(env))
    async with running(gateway) as api:
        assert (await api.get("/admin/v1/dead-letters", headers=ADMIN)).status_code == 200
        await link.cut()

        async def broker_down() -> bool:
            ready = await api.get("/readyz")
            return ready.status_code == 503

        await eventually(broker_down, what="the gateway saw the broker go")
        for method, path in (
            ("GET", "/admin/v1/dead-letters"),
            ("DELETE", "/admin/v1/dead-letters/some-letter"),
            ("DELETE", "/admin/v1/dead-letters"),
        ):
            async with asyncio.timeout(60):
                answer = await api.request(method, path, headers=ADMIN)
            assert answer.status_code == 503, answer.text
            assert answer.headers["content-type"].startswith(PROBLEM_JSON)
            assert "Retry-After" in answer.headers
            # The type every other 503 of a dependency away has (it was service-unavailable).
            assert answer.json()["type"].endswith("/unavailable"), answer.json()
        link.down = False  # the gateway stops on a broker that is back
