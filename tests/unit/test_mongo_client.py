"""The services' MongoDB client: one deadline per operation, from `MONGO_TIMEOUT_S`."""

from __future__ import annotations

import pytest

from shared.runtime import make_mongo
from shared.settings import MIN_INFRA_TIMEOUT_S, ServiceSettings


async def test_every_operation_has_one_deadline_of_mongo_timeout_s() -> None:
    settings = ServiceSettings.model_validate({"MONGO_TIMEOUT_S": "1.5"})
    client = make_mongo(settings)
    try:
        # `timeout` is the client-side operation timeout (timeoutMS): it covers server
        # selection, reconnecting and the driver's retry, not just one socket read.
        assert client.options.timeout == 1.5
        assert client.options.server_selection_timeout == 1.5
        assert client.options.pool_options.connect_timeout == 1.5
    finally:
        await client.close()


async def test_the_shortest_mongo_timeout_still_bounds_every_operation() -> None:
    """Under a millisecond, `MONGO_TIMEOUT_S` became `timeoutMS=0`: PyMongo's "no timeout"
    (and a group-write deadline of 0 that failed every write); it is refused now, and the
    shortest accepted is a deadline of its own."""
    settings = ServiceSettings.model_validate({"MONGO_TIMEOUT_S": str(MIN_INFRA_TIMEOUT_S)})
    client = make_mongo(settings)
    try:
        assert client.options.timeout == MIN_INFRA_TIMEOUT_S
        assert client.options.pool_options.socket_timeout == MIN_INFRA_TIMEOUT_S
    finally:
        await client.close()


async def test_writes_are_acknowledged_once_journaled_by_a_majority() -> None:
    """A consumer settles its delivery once its write is acknowledged: acknowledged before
    the journal commit (a standalone server's default) or by the primary alone, the write
    could be lost with the message already gone."""
    client = make_mongo(ServiceSettings.model_validate({}))
    try:
        assert client.write_concern.document == {"w": "majority", "j": True}
    finally:
        await client.close()


@pytest.mark.parametrize(
    ("query", "concern"),
    [
        ("W=1&Journal=false", {"w": 1, "j": False}),
        ("w=1;journal=false", {"w": 1, "j": False}),
        ("w=0", {"w": 0}),
        ("fsync=true", {"fsync": True}),
        ("w=2&wtimeoutMS=500", {"w": 2, "wtimeout": 500}),
    ],
    ids=["cases", "semicolons", "unacknowledged", "fsync", "wtimeout"],
)
async def test_a_write_concern_of_the_url_is_used_as_given(
    query: str, concern: dict[str, object]
) -> None:
    """Any write concern option of the URL leaves ours out: `journal` beside `w=0` or
    `fsync` is refused by PyMongo, and `;`-separated options were missed (review)."""
    url = f"mongodb://127.0.0.1:27017/?{query}"
    client = make_mongo(ServiceSettings.model_validate({"MONGO_URL": url}))
    try:
        assert client.write_concern.document == concern
    finally:
        await client.close()
