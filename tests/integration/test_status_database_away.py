"""The status service's reads answer 503 at once while its database is known away, rather
than each waiting the whole server selection (`MONGO_TIMEOUT_S`) for the same 503: the
gateway's status client gave up on them at `STATUS_TIMEOUT_S` poll after poll, so a client
with a short timeout never saw the 503 (a review). A real status service, in-process, its
database reached through a proxy the test cuts; the gate's clock is the test's, so that
which read is the second's probe does not depend on the machine's speed."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator

import httpx
import pytest

from devtools.infra import Endpoint
from services.status.app import create_app
from services.status.settings import StatusSettings
from shared.away_gate import AwayGate
from shared.coalescing import server_watch
from shared.http import PROBLEM_JSON, database_unavailable
from shared.runtime import make_mongo
from tests.faults.slow_link import SlowLink
from tests.support import eventually, running
from tests.unit.test_auth_keys import Ticker

SOME_ID = "0123456789abcdef0123456789abcdef"
# Each read, and its answer while the database answers: no such task, no item of the batch.
READS = {
    "task": (f"/internal/v1/tasks/{SOME_ID}?tenant_id=default", 404),
    "history": (f"/internal/v1/tasks/{SOME_ID}/history?tenant_id=default", 404),
    "batch": (f"/internal/v1/batches/{SOME_ID}?tenant_id=default", 200),
}
SELECTION_LOG = "pymongo.serverSelection"


class Reads:
    """The status service's reads, and the server selections the driver started for them."""

    def __init__(
        self,
        api: httpx.AsyncClient,
        ticker: Ticker,
        caplog: pytest.LogCaptureFixture,
        path: str,
        answered: int,
    ):
        self.api, self.ticker, self.caplog = api, ticker, caplog
        self.path, self.answered = path, answered

    def selections(self) -> int:
        """How many server selections the driver started so far."""
        return sum(
            record.name == SELECTION_LOG and "selection started" in record.getMessage()
            for record in self.caplog.records
        )

    def found_no_server(self) -> bool:
        """Whether a read was answered 503 for a server selection that timed out."""
        return any(
            record.name == "scorebox.http" and "ServerSelectionTimeoutError" in record.getMessage()
            for record in self.caplog.records
        )

    async def read(self) -> httpx.Response:
        return await self.api.get(self.path)


@pytest.fixture(params=list(READS))
async def reads(
    request: pytest.FixtureRequest,
    amqp_url: str,
    mongo: Endpoint,
    db_prefix: str,
    database_link: SlowLink,
    caplog: pytest.LogCaptureFixture,
) -> AsyncIterator[Reads]:
    settings = StatusSettings.model_validate(
        {
            "RABBITMQ_URL": amqp_url,
            "MONGO_URL": database_link.url_through(mongo.url, query="directConnection=true"),
            "MONGO_DB_PREFIX": db_prefix,
            "MONGO_TIMEOUT_S": "1",
        }
    )
    client = make_mongo(settings)
    ticker = Ticker()
    away = AwayGate(
        known=server_watch(client).known,
        refusal=lambda: database_unavailable("GET"),
        clock=ticker,
    )
    async with running(create_app(settings, mongo=client, away=away)) as api:
        yield Reads(api, ticker, caplog, *READS[request.param])


async def test_reads_are_refused_at_once_while_the_database_is_known_away_and_come_back(
    reads: Reads, database_link: SlowLink
) -> None:
    reads.caplog.set_level(logging.DEBUG, logger=SELECTION_LOG)
    assert (await reads.read()).status_code == reads.answered
    await database_link.cut()

    # A read on a pooled connection the cut closed fails on it (AutoReconnect), which proves
    # no absence; the next waits out a server selection, which does.
    for _ in range(3):
        failed = await reads.read()
        assert failed.status_code == 503, failed.text
        if reads.found_no_server():
            break
    assert reads.found_no_server()
    before = reads.selections()
    for _ in range(3):
        refused = await reads.read()
        assert refused.status_code == 503, refused.text
        assert refused.headers["content-type"].startswith(PROBLEM_JSON)
        assert refused.headers["retry-after"] == "5"
    assert reads.selections() == before  # none of them went to the driver

    database_link.down = False

    async def answered() -> bool:
        reads.ticker.now += 1.0  # each try the second's probe
        return (await reads.read()).status_code == reads.answered

    await eventually(answered, what="reads answered again once the database is back")
