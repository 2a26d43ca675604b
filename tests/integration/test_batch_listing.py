"""`GET /v1/batches`: a tenant's batches, newest first, a page at a time (found in a walkthrough:
a client whose connection was reset while it posted a batch had no `batch_id`, and no way to
find the batch again without its Idempotency-Key). In-process gateway and status service on
the real broker and database; each test lists a tenant of its own."""

from __future__ import annotations

import base64
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import httpx
import pytest
from pymongo import AsyncMongoClient

from services.gateway.app import create_app as create_gateway
from services.gateway.batches import (
    Batches,
    BatchMember,
    BatchRecord,
    BatchState,
    ListPosition,
)
from services.gateway.batches_api import list_cursor
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.contracts import new_id, to_millis, utcnow
from tests.support import running, stack_env

ADMIN_KEY = "test-admin-key"
RETENTION = timedelta(days=1)


@dataclass
class Listing:
    api: httpx.AsyncClient
    records: Batches  # the gateway's repository, on its database
    mongo: AsyncMongoClient[dict[str, Any]]
    db_prefix: str

    async def tenant(self) -> tuple[str, dict[str, str]]:
        """A new tenant's id and the headers of a key of it."""
        tenant_id = f"list-{uuid.uuid4().hex[:8]}"
        created = await self.api.post(
            "/admin/v1/keys",
            json={"tenant_id": tenant_id},
            headers={"Authorization": f"Bearer {ADMIN_KEY}"},
        )
        assert created.status_code == 201, created.text
        return tenant_id, {"Authorization": f"Bearer {created.json()['key']}"}

    async def submit(self, headers: dict[str, str], items: int) -> str:
        body = {"items": [{"text": f"Essay {i} of a listed batch."} for i in range(items)]}
        response = await self.api.post("/v1/batches", json=body, headers=headers)
        assert response.status_code == 202, response.text
        batch_id: str = response.json()["batch_id"]
        return batch_id

    async def page(self, headers: dict[str, str], **params: Any) -> dict[str, Any]:
        response = await self.api.get("/v1/batches", params=params, headers=headers)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        assert body["count"] == len(body["items"])
        return body

    async def every_page(self, headers: dict[str, str], limit: int) -> list[dict[str, Any]]:
        pages: list[dict[str, Any]] = []
        params: dict[str, Any] = {"limit": limit}
        for _ in range(100):
            page = await self.page(headers, **params)
            assert len(page["items"]) <= limit
            pages.append(page)
            if page["next_cursor"] is None:
                return pages
            params["cursor"] = page["next_cursor"]
        raise AssertionError("pagination did not end")

    async def record(
        self, tenant_id: str, *, items: int = 1, created_at: Any = None, retention: Any = RETENTION
    ) -> BatchRecord:
        """A batch recorded as its request records it first (`accepting`), nothing sent."""
        record = BatchRecord(
            batch_id=new_id(),
            tenant_id=tenant_id,
            state=BatchState.ACCEPTING,
            request_hash="0" * 64,
            created_at=to_millis(created_at or utcnow()),
            members=tuple(BatchMember(new_id(), None) for _ in range(items)),
        )
        await self.records.insert(record, idempotency_key=None, retention=retention)
        return record

    async def kept(self) -> tuple[int, int]:
        """(batches, submissions) the gateway holds."""
        database = self.mongo[f"{self.db_prefix}_gateway"]
        return (
            await database["batches"].count_documents({}),
            await database["submissions"].count_documents({}),
        )


@pytest.fixture(scope="module")
async def listing(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Listing]:
    env = stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_url="http://127.0.0.1:9",  # no scorer runs: nothing is scored
        api_key=generate_key().token,
        admin_key=ADMIN_KEY,
    )
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    status = create_status(StatusSettings.model_validate(env))
    async with running(status) as status_client:
        gateway = create_gateway(GatewaySettings.model_validate(env), status_http=status_client)
        async with running(gateway) as api:
            records = Batches(client, f"{db_prefix}_gateway")
            yield Listing(api, records, client, db_prefix)
    await client.close()


def _ids(pages: list[dict[str, Any]]) -> list[str]:
    return [item["batch_id"] for page in pages for item in page["items"]]


def _assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["detail"]
    return body


async def test_batches_are_listed_newest_first_a_page_at_a_time_each_once(
    listing: Listing,
) -> None:
    _, headers = await listing.tenant()
    submitted = [await listing.submit(headers, items) for items in range(1, 8)]

    pages = await listing.every_page(headers, limit=3)

    assert [page["count"] for page in pages] == [3, 3, 1]
    assert _ids(pages) == submitted[::-1]  # newest first, no duplicate, no gap
    items = [item for page in pages for item in page["items"]]
    assert [item["total"] for item in items] == list(range(7, 0, -1))
    assert [item["status_url"] for item in items] == [f"/v1/batches/{i}" for i in _ids(pages)]
    created = [item["created_at"] for item in items]
    assert created == sorted(created, reverse=True)
    assert all(at.endswith("Z") for at in created)
    # One page by default (20), the last: no cursor.
    whole = await listing.page(headers)
    assert [item["batch_id"] for item in whole["items"]] == submitted[::-1]
    assert whole["next_cursor"] is None
    # What is listed is readable at its URL.
    read = await listing.api.get(items[0]["status_url"], headers=headers)
    assert read.status_code == 200, read.text
    assert read.json()["total"] == 7


async def test_batches_of_the_same_millisecond_are_paged_without_duplicates_or_gaps(
    listing: Listing,
) -> None:
    """`_id` breaks ties of `created_at`: a cursor on the time alone skipped (or repeated)
    batches that share the millisecond of a page's last one."""
    tenant_id, headers = await listing.tenant()
    at = utcnow()
    records = [await listing.record(tenant_id, created_at=at) for _ in range(5)]
    older = await listing.record(tenant_id, created_at=at - timedelta(seconds=1))

    pages = await listing.every_page(headers, limit=2)

    same_millisecond = sorted((record.batch_id for record in records), reverse=True)
    assert _ids(pages) == [*same_millisecond, older.batch_id]


async def test_another_tenants_batches_never_appear(listing: Listing) -> None:
    _, mine = await listing.tenant()
    _, theirs = await listing.tenant()
    my_batches = [await listing.submit(mine, 2) for _ in range(2)]
    their_batch = await listing.submit(theirs, 1)

    assert _ids(await listing.every_page(mine, limit=1)) == my_batches[::-1]
    assert _ids(await listing.every_page(theirs, limit=1)) == [their_batch]


async def test_another_tenants_cursor_lists_only_this_tenants_batches_from_its_position(
    listing: Listing,
) -> None:
    """A cursor is a position (a time and an id) and says nothing of its tenant: it carried
    an unsalted hash of the tenant's id, which a cursor seen in a log let anyone check a
    guessed tenant name against (a walkthrough). Another tenant's lists this tenant's own
    batches from that position, never theirs."""
    _, mine = await listing.tenant()
    _, theirs = await listing.tenant()
    their_older = await listing.submit(theirs, 1)
    for _ in range(2):
        await listing.submit(mine, 1)
    their_newer = await listing.submit(theirs, 1)
    cursor = (await listing.page(mine, limit=1))["next_cursor"]
    assert cursor is not None
    millis, batch_id = base64.urlsafe_b64decode(cursor + "==").decode().split(":")
    assert millis.isdigit()  # a position: a time and an id, nothing of the tenant
    assert batch_id == (await listing.page(mine, limit=1))["items"][0]["batch_id"]

    answer = await listing.api.get("/v1/batches", params={"cursor": cursor}, headers=theirs)

    assert answer.status_code == 200, answer.text
    assert [item["batch_id"] for item in answer.json()["items"]] == [their_older]
    assert their_newer not in answer.text


async def test_tombstones_and_expired_batches_are_not_listed_one_being_accepted_is(
    listing: Listing,
) -> None:
    """A batch still `accepting` (its request running, or its 202 lost while the outbox sweep
    sends its items) is the one a client looks for; a refused batch (a tombstone) and one
    past its expiry (the TTL monitor runs once a minute) are not there to read."""
    tenant_id, headers = await listing.tenant()
    accepted = await listing.submit(headers, 2)
    accepting = await listing.record(tenant_id, items=3)
    refused = await listing.record(tenant_id)
    assert await listing.records.abandon(refused.batch_id, now=utcnow())
    await listing.record(tenant_id, created_at=utcnow() - 2 * RETENTION)  # expired

    listed = (await listing.page(headers))["items"]

    assert [item["batch_id"] for item in listed] == [accepting.batch_id, accepted]
    assert listed[0]["total"] == 3


async def test_a_batch_past_its_expiry_is_left_out_before_the_ttl_monitor_removes_it(
    listing: Listing,
) -> None:
    """MongoDB's TTL monitor removes an expired record within a minute or so; until then the
    listing leaves it out by the gateway's clock (here set a retention ahead: the stand-in
    hides expired records itself)."""
    tenant_id, _ = await listing.tenant()
    record = await listing.record(tenant_id)
    now = utcnow()

    listed = await listing.records.newest(tenant_id, now=now, after=None, limit=10)
    later = await listing.records.newest(tenant_id, now=now + RETENTION, after=None, limit=10)

    assert [batch.batch_id for batch in listed] == [record.batch_id]
    assert later == []


def _encoded(raw: str) -> str:
    return base64.urlsafe_b64encode(raw.encode()).decode().rstrip("=")


NOT_OF_THIS_LISTING = "is not a `next_cursor` of this listing"


@pytest.mark.parametrize(
    ("query", "field", "message"),
    [
        ("limit=0", "query.limit", "greater than or equal to 1"),
        ("limit=101", "query.limit", "less than or equal to 100"),
        ("limit=ten", "query.limit", "valid integer"),
        ("cursor=", "query.cursor", NOT_OF_THIS_LISTING),
        ("cursor=abc", "query.cursor", NOT_OF_THIS_LISTING),
        ("cursor=1", "query.cursor", NOT_OF_THIS_LISTING),  # a batch read's cursor
        ("cursor=%D9%A1", "query.cursor", NOT_OF_THIS_LISTING),  # U+0661
        (f"cursor={_encoded('12:abc:' + '0' * 16)}", "query.cursor", NOT_OF_THIS_LISTING),
        # Past `datetime`'s year 9999: a 422, not a 500.
        (
            f"cursor={_encoded('999999999999999:b1')}",
            "query.cursor",
            NOT_OF_THIS_LISTING,
        ),
        (f"cursor={_encoded('1:../x')}", "query.cursor", NOT_OF_THIS_LISTING),
        ("limit=1&limit=2", "query.limit", "must be given once"),
        ("cursor=a&cursor=b", "query.cursor", "must be given once"),
        ("limit=1&tenant_id=other", "query.tenant_id", "is not a parameter of this route"),
    ],
)
async def test_a_bad_limit_or_cursor_is_a_422_naming_it_and_changes_nothing(
    listing: Listing, query: str, field: str, message: str
) -> None:
    _, headers = await listing.tenant()
    await listing.submit(headers, 1)
    before = await listing.kept()

    answer = await listing.api.get(f"/v1/batches?{query}", headers=headers)

    problem = _assert_problem(answer, 422)
    assert problem["type"].endswith("/invalid-fields")
    assert [error["field"] for error in problem["errors"]] == [field]
    assert message in problem["errors"][0]["message"]
    assert await listing.kept() == before


async def test_a_cursor_from_the_far_future_lists_every_batch(listing: Listing) -> None:
    """The largest position a cursor holds (14 digits of milliseconds, the year 5138) is one
    like any other: `datetime` takes it."""
    _, headers = await listing.tenant()
    batch_id = await listing.submit(headers, 1)
    far = ListPosition(to_millis(utcnow()).replace(year=5000), "z")

    page = await listing.page(headers, cursor=list_cursor(far))

    assert [item["batch_id"] for item in page["items"]] == [batch_id]


async def test_listing_needs_a_key(listing: Listing) -> None:
    answer = await listing.api.get("/v1/batches")
    _assert_problem(answer, 401)
