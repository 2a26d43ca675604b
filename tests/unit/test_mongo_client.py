"""The services' MongoDB client: one deadline per operation, from `MONGO_TIMEOUT_S`."""

from __future__ import annotations

from shared.runtime import make_mongo
from shared.settings import ServiceSettings


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
