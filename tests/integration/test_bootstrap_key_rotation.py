"""A new `BOOTSTRAP_API_KEY` replaces the earlier one on a database that outlives the gateway
(compose's volume, `make run` with `MONGO_URL`): the earlier key stops working, one way only.
Real gateway and status service, in-process, on the test broker and database."""

from __future__ import annotations

from collections.abc import Mapping

import httpx

from devtools.infra import Endpoint
from services.gateway.keys import generate_key
from tests.integration.in_process import gateway_and_status

ADMIN_KEY = "bootstrap-rotation-admin-key"
SOME_TASK = "0123456789abcdef0123456789abcdef"


def _env(amqp_url: str, mongo: Endpoint, db_prefix: str, bootstrap: str) -> dict[str, str]:
    return {
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": db_prefix,
        "ADMIN_API_KEY": ADMIN_KEY,
        "BOOTSTRAP_API_KEY": bootstrap,
        "API_KEY_CACHE_TTL_S": "0",
    }


async def _opens(api: httpx.AsyncClient, token: str) -> bool:
    """Whether `token` is taken: an unknown task is a 404 to a known key, a 401 otherwise."""
    answer = await api.get(f"/v1/scores/{SOME_TASK}", headers={"Authorization": f"Bearer {token}"})
    assert answer.status_code in (401, 404), answer.text
    return answer.status_code == 404


async def _made_by_the_admin(api: httpx.AsyncClient) -> str:
    made = await api.post(
        "/admin/v1/keys",
        json={"tenant_id": "default", "name": "ci"},
        headers={"Authorization": f"Bearer {ADMIN_KEY}"},
    )
    assert made.status_code == 201, made.text
    assert made.headers["cache-control"] == "no-store"  # the only time the key is shown
    token: str = made.json()["key"]
    return token


async def test_a_new_bootstrap_key_revokes_the_earlier_one_and_a_restart_on_it_revives_nothing(
    amqp_url: str, mongo: Endpoint, db_prefix: str
) -> None:
    old, new = generate_key().token, generate_key().token
    env: Mapping[str, str] = _env(amqp_url, mongo, db_prefix, old)
    async with gateway_and_status(env) as first:
        assert await _opens(first.api, old)
        admins = await _made_by_the_admin(first.api)

    async with gateway_and_status({**env, "BOOTSTRAP_API_KEY": new}) as second:
        assert await _opens(second.api, new)
        assert not await _opens(second.api, old)
        assert await _opens(second.api, admins)  # another name: not a bootstrap key

    # A replica still started with the old value (a rolling change) revives nothing and
    # revokes nothing of the new key.
    async with gateway_and_status(env) as late:
        assert not await _opens(late.api, old)
        assert await _opens(late.api, new)
