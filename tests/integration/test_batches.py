"""Batches end to end in-process — gateway, scorer, status — on the real broker and database,
the fake model scoring each item."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from services.gateway.app import create_app as create_gateway
from services.gateway.keys import generate_key
from services.gateway.settings import GatewaySettings
from services.scorer.app import create_app as create_scorer
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.contracts import new_id
from shared.http import MAX_ERRORS_SHOWN
from tests.support import eventually, running, stack_env

ADMIN_KEY = "test-admin-key"
MAX_ITEMS = 50
MAX_TEXT = 2_000


@dataclass
class Batches:
    api: httpx.AsyncClient
    other: dict[str, str]  # headers of another tenant's key
    llm: FakeLLM
    mongo: AsyncMongoClient[dict[str, Any]]
    db_prefix: str

    async def submit(self, body: dict[str, Any], **kwargs: Any) -> httpx.Response:
        return await self.api.post("/v1/batches", json=body, **kwargs)

    async def read(self, batch_id: str, **params: Any) -> dict[str, Any]:
        response = await self.api.get(f"/v1/batches/{batch_id}", params=params)
        assert response.status_code == 200, response.text
        body: dict[str, Any] = response.json()
        return body

    async def kept(self) -> tuple[int, int]:
        """(batches, submissions) the gateway holds."""
        database = self.mongo[f"{self.db_prefix}_gateway"]
        return (
            await database["batches"].count_documents({}),
            await database["submissions"].count_documents({}),
        )


@pytest.fixture(scope="module")
async def batches(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Batches]:
    llm = await start_fake_llm(FakeLLMConfig())
    key = generate_key().token
    env = stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_url=llm.url,
        api_key=key,
        admin_key=ADMIN_KEY,
        MAX_BATCH_ITEMS=str(MAX_ITEMS),
        MAX_TEXT_CHARS=str(MAX_TEXT),
    )
    scorer = create_scorer(ScorerSettings.model_validate(env), ModelSettings.model_validate(env))
    status = create_status(StatusSettings.model_validate(env))
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    async with running(status) as status_client, running(scorer):
        gateway = create_gateway(GatewaySettings.model_validate(env), status_http=status_client)
        async with running(gateway) as api:
            api.headers["Authorization"] = f"Bearer {key}"
            created = await api.post(
                "/admin/v1/keys",
                json={"tenant_id": f"other-{uuid.uuid4().hex[:8]}"},
                headers={"Authorization": f"Bearer {ADMIN_KEY}"},
            )
            assert created.status_code == 201, created.text
            other = {"Authorization": f"Bearer {created.json()['key']}"}
            yield Batches(api, other, llm, client, db_prefix)
    await client.close()
    await llm.stop()


def _items(count: int, *, prefix: str = "doc") -> list[dict[str, Any]]:
    run = uuid.uuid4().hex[:8]
    return [
        {"client_id": f"{prefix}-{i}", "text": f"Essay {i} of a batch [[id:b{run}{i}]]"}
        for i in range(count)
    ]


def _assert_problem(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/problem+json")
    body: dict[str, Any] = response.json()
    assert body["status"] == status
    assert body["detail"]
    return body


async def _all_pages(batches: Batches, batch_id: str, limit: int) -> list[dict[str, Any]]:
    items: list[dict[str, Any]] = []
    cursor: str | None = None
    for _ in range(100):
        params: dict[str, Any] = {"limit": limit}
        if cursor is not None:
            params["cursor"] = cursor
        page = await batches.read(batch_id, **params)
        assert len(page["items"]) <= limit
        items.extend(page["items"])
        cursor = page["next_cursor"]
        if cursor is None:
            return items
    raise AssertionError("pagination did not end")


async def test_a_batch_is_accepted_in_order_and_converges_to_completed(batches: Batches) -> None:
    items = _items(20)
    response = await batches.submit({"items": items, "rubric": "clarity"})
    assert response.status_code == 202, response.text
    accepted = response.json()
    batch_id = accepted["batch_id"]
    assert response.headers["location"] == accepted["status_url"] == f"/v1/batches/{batch_id}"
    assert accepted["total"] == 20
    assert [item["index"] for item in accepted["items"]] == list(range(20))
    assert [item["client_id"] for item in accepted["items"]] == [i["client_id"] for i in items]
    task_ids = [item["task_id"] for item in accepted["items"]]
    assert len(set(task_ids)) == 20

    # Read-your-writes: right after the 202 every item is accounted for.
    first = await batches.read(batch_id)
    assert first["total"] == 20
    assert sum(first["counts"].values()) == 20
    assert [item["task_id"] for item in first["items"]] == task_ids
    # Each task is also a task of its own.
    single = await batches.api.get(accepted["items"][3]["status_url"])
    assert single.status_code == 200
    assert single.json()["task_id"] == task_ids[3]

    async def all_completed() -> dict[str, Any] | None:
        view = await batches.read(batch_id)
        return view if view["counts"]["completed"] == 20 else None

    done = await eventually(all_completed, timeout_s=90, what="every item completed")
    assert sum(done["counts"].values()) == 20

    pages = await _all_pages(batches, batch_id, limit=7)
    assert [item["index"] for item in pages] == list(range(20))  # each once, in order
    assert [item["task_id"] for item in pages] == task_ids
    assert [item["client_id"] for item in pages] == [i["client_id"] for i in items]
    for item in pages:
        assert item["status"] == "completed"
        assert 0 <= item["result"]["score"] <= 10
        assert item["result"]["model"] == "fake-judge-1-2024-07-18"
        assert item["error"] is None
    view = (await batches.api.get(f"/v1/scores/{task_ids[0]}")).json()
    assert view["rubric"] == "clarity"


async def test_items_override_the_batch_rubric_and_the_failures_are_counted(
    batches: Batches,
) -> None:
    run = uuid.uuid4().hex[:8]
    response = await batches.submit(
        {
            "rubric": "batch rubric",
            "items": [
                # A blank rubric names none: the batch's applies (it was kept, and the
                # scorer's default rubric scored the text; found in review).
                {"text": f"Fine [[id:c{run}0]]", "rubric": "  "},
                {"text": f"Own rubric [[id:c{run}1]]", "rubric": "item rubric"},
                {"text": f"Refused [[id:c{run}2]] [[fake:reject]]"},
            ],
        }
    )
    assert response.status_code == 202, response.text
    accepted = response.json()

    async def finished() -> dict[str, Any] | None:
        view = await batches.read(accepted["batch_id"])
        counts = view["counts"]
        return view if counts["completed"] + counts["failed"] == 3 else None

    view = await eventually(finished, timeout_s=60, what="batch finished")
    assert view["counts"]["failed"] == 1
    assert [item["client_id"] for item in view["items"]] == [None, None, None]
    assert view["items"][2]["status"] == "failed"
    assert view["items"][2]["error"]["code"] == "input_rejected"
    rubrics = [
        (await batches.api.get(item["status_url"])).json()["rubric"] for item in accepted["items"]
    ]
    assert rubrics == ["batch rubric", "item rubric", "batch rubric"]


@pytest.mark.parametrize(
    ("bad_item", "field"),
    [
        pytest.param({"text": " "}, "items[5].text", id="blank-text"),
        pytest.param({"text": "\u0001"}, "items[5].text", id="control-character-text"),
        pytest.param({"text": "\u0000\u0080 \t"}, "items[5].text", id="controls-and-blanks"),
        pytest.param({"text": "hi", "colour": "red"}, "items[5].colour", id="unknown-field"),
        pytest.param({"text": "hi", "metadata": {"$where": 1}}, "items[5].metadata", id="op"),
        pytest.param({"text": "hi", "metadata": {"n": 2**63}}, "items[5].metadata", id="int64"),
        pytest.param(
            {"text": "hi", "metadata": {"n": 2**70 + 1}}, "items[5].metadata", id="beyond-uint64"
        ),
        pytest.param({"text": "hi", "client_id": "doc-1"}, "items[5].client_id", id="dup-id"),
    ],
)
async def test_one_bad_item_fails_the_batch_and_nothing_is_kept(
    batches: Batches, bad_item: dict[str, Any], field: str
) -> None:
    items = _items(8)
    items[5] = bad_item
    before = await batches.kept()
    problem = _assert_problem(await batches.submit({"items": items}), 422)
    assert "items[5]" in problem["detail"]
    assert problem["invalid_items"] == [5]
    assert [error["field"] for error in problem["errors"]] == [field]
    assert await batches.kept() == before


async def test_an_item_with_content_among_control_characters_is_accepted_and_scored(
    batches: Batches,
) -> None:
    """The gateway refuses only a text the scorer would find empty once normalised."""
    items = _items(2)
    items[1]["text"] = f"\u0000\u0001 {items[1]['text']}\u0080 \t"
    response = await batches.submit({"items": items})
    assert response.status_code == 202, response.text
    batch_id = response.json()["batch_id"]

    async def finished() -> dict[str, Any] | None:
        view = await batches.read(batch_id)
        counts = view["counts"]
        return view if counts["completed"] + counts["failed"] == 2 else None

    view = await eventually(finished, timeout_s=60, what="batch finished")
    assert [item["status"] for item in view["items"]] == ["completed", "completed"]


async def test_an_item_text_over_the_limit_is_a_413_as_for_one_submission(
    batches: Batches,
) -> None:
    """It was a 422 in a batch, and a 413 (`text-too-long`) on its own."""
    items = _items(8)
    items[2] = items[5] = {"text": "x" * (MAX_TEXT + 1)}
    before = await batches.kept()
    problem = _assert_problem(await batches.submit({"items": items}), 413)
    assert problem["type"].endswith("/text-too-long")
    assert problem["invalid_items"] == [2, 5]
    assert await batches.kept() == before


async def test_a_batch_of_many_unknown_fields_names_a_few_and_keeps_nothing(
    batches: Batches,
) -> None:
    """Each unknown key was an error of its own, every one described: a batch of 15 MiB of
    them took the gateway's loop for 10 s and 2.3 GB for a 156 MiB answer (review)."""
    items = _items(MAX_ITEMS)
    for item in items:
        item.update({f"k{key}": 0 for key in range(40)})
    before = await batches.kept()
    problem = _assert_problem(await batches.submit({"items": items, "extra": 1}), 422)
    assert len(problem["errors"]) == MAX_ERRORS_SHOWN
    assert problem["errors"][:2] == [
        {"field": "extra", "message": "Extra inputs are not permitted"},
        {"field": "items[0].k0", "message": "Extra inputs are not permitted"},
    ]
    assert problem["invalid_items"] == [0, 1]
    assert "more unknown fields, not listed" in problem["detail"]
    assert await batches.kept() == before


async def test_a_few_unknown_fields_are_named_with_the_batchs_other_errors(
    batches: Batches,
) -> None:
    items = _items(8)
    items[3] = {"text": " ", "colour": "red"}
    problem = _assert_problem(await batches.submit({"items": items}), 422)
    assert {each["field"] for each in problem["errors"]} == {"items[3].text", "items[3].colour"}
    assert problem["invalid_items"] == [3]


async def test_a_batch_of_many_errors_lists_only_the_first(batches: Batches) -> None:
    items = [{"text": " ", "client_id": ""} for _ in range(MAX_ITEMS)]
    problem = _assert_problem(await batches.submit({"items": items}), 422)
    assert len(problem["errors"]) == MAX_ERRORS_SHOWN
    assert problem["detail"].endswith(
        f"and {2 * MAX_ITEMS - MAX_ERRORS_SHOWN} more errors, not listed"
    )
    assert problem["invalid_items"] == list(range(MAX_ITEMS))


@pytest.mark.parametrize(
    ("body", "status"),
    [
        pytest.param({"items": []}, 422, id="no-items"),
        pytest.param({"items": _items(MAX_ITEMS + 1)}, 422, id="too-many-items"),
        pytest.param({"texts": ["a"]}, 422, id="unknown-field"),
        pytest.param(["a"], 422, id="not-an-object"),
    ],
)
async def test_bad_batches_are_problems(batches: Batches, body: Any, status: int) -> None:
    before = await batches.kept()
    _assert_problem(await batches.api.post("/v1/batches", json=body), status)
    assert await batches.kept() == before


async def test_too_many_items_names_the_field_as_every_422_does(batches: Batches) -> None:
    """It was the one 422 of the route without `errors` (the README: each field named) or
    `invalid_items`."""
    answer = await batches.api.post("/v1/batches", json={"items": _items(MAX_ITEMS + 1)})
    problem = _assert_problem(answer, 422)
    assert problem["errors"] == [
        {"field": "items", "message": f"a batch has at most {MAX_ITEMS} items, not {MAX_ITEMS + 1}"}
    ]
    assert problem["invalid_items"] == []


async def test_wrong_content_type_and_bad_json(batches: Batches) -> None:
    _assert_problem(
        await batches.api.post(
            "/v1/batches", content=b'{"items": []}', headers={"content-type": "text/plain"}
        ),
        415,
    )
    _assert_problem(
        await batches.api.post(
            "/v1/batches", content=b'{"items": [', headers={"content-type": "application/json"}
        ),
        400,
    )


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/v1/scores", b'{"text": "Essay one.", "text": "Essay two."}', "text"),
        (
            "/v1/batches",
            b'{"items": [{"client_id": "a", "text": "One.", "client_id": "b"}]}',
            "items.0.client_id",
        ),
    ],
)
async def test_a_key_given_twice_is_a_422_naming_it_and_nothing_is_kept(
    batches: Batches, path: str, body: bytes, field: str
) -> None:
    """The last of the two was taken without a word: `{"text": "a", "text": "b"}` scored
    "b", which a client (or a proxy) reading the first did not send."""
    before = await batches.kept()

    answer = await batches.api.post(
        path, content=body, headers={"content-type": "application/json"}
    )

    problem = _assert_problem(answer, 422)
    message = "is given more than once in its object; give each key once"
    assert problem["errors"] == [{"field": field, "message": message}]
    assert await batches.kept() == before


@pytest.mark.parametrize("path", ["/v1/scores", "/v1/batches"])
async def test_a_body_not_utf_8_is_said_to_be_so_and_nothing_is_kept(
    batches: Batches, path: str
) -> None:
    """Its 400 gave orjson's words: "str is not valid UTF-8: surrogates not allowed"."""
    before = await batches.kept()
    body = b'{"text": "Caf\xe9 au lait."}'  # Latin-1, sent as UTF-8

    answer = await batches.api.post(
        path, content=body, headers={"content-type": "application/json"}
    )

    problem = _assert_problem(answer, 400)
    assert problem["detail"].startswith("The body is not valid UTF-8 (at byte 13, counting from 0)")
    assert "surrogates" not in problem["detail"]
    assert await batches.kept() == before


async def test_idempotency_key_returns_the_same_batch_or_409(batches: Batches) -> None:
    key = uuid.uuid4().hex
    items = _items(3)
    first = await batches.submit({"items": items}, headers={"Idempotency-Key": key})
    again = await batches.submit({"items": items}, headers={"Idempotency-Key": key})
    other = await batches.submit({"items": _items(3)}, headers={"Idempotency-Key": key})
    assert first.status_code == 202
    assert again.status_code == 200
    assert again.json() == first.json()
    _assert_problem(other, 409)


async def test_another_tenants_batch_is_404(batches: Batches) -> None:
    response = await batches.submit({"items": _items(2)})
    batch_id = response.json()["batch_id"]
    _assert_problem(await batches.api.get(f"/v1/batches/{batch_id}", headers=batches.other), 404)
    _assert_problem(await batches.api.get(f"/v1/batches/{new_id()}"), 404)
    # A cursor that is none of the batch's: a 422 naming it, as the listing answers one (it
    # was a 400 without `errors`; found in a walkthrough).
    for cursor in ("abc", "2"):
        refused = _assert_problem(
            await batches.api.get(f"/v1/batches/{batch_id}?cursor={cursor}"), 422
        )
        assert refused["type"].endswith("/invalid-fields")
        assert [error["field"] for error in refused["errors"]] == ["query.cursor"]


@pytest.mark.parametrize(
    "cursor",
    # U+0661 ARABIC-INDIC DIGIT ONE, U+FF11 FULLWIDTH DIGIT ONE, U+0967 DEVANAGARI DIGIT ONE
    ["%D9%A1", "%EF%BC%91", "%E0%A5%A7"],
)
async def test_a_cursor_of_other_digits_than_ascii_is_422(batches: Batches, cursor: str) -> None:
    """`\\d` took any script's digit, which `int` reads: U+0661 was the page after item 1."""
    batch_id = (await batches.submit({"items": _items(3)})).json()["batch_id"]
    page = await batches.api.get(f"/v1/batches/{batch_id}?limit=1&cursor={cursor}")
    assert _assert_problem(page, 422)["errors"][0]["field"] == "query.cursor"


@pytest.mark.parametrize(
    "query",
    [
        "limt=1",  # misspelt: was ignored, a page of 100 answered
        "cursor=1&cursor=2",  # twice: the last was taken
        "limit=1&limit=2",
        "limit=1&tenant_id=other",
    ],
)
async def test_a_batch_read_refuses_other_or_repeated_query_parameters(
    batches: Batches, query: str
) -> None:
    batch_id = (await batches.submit({"items": _items(3)})).json()["batch_id"]
    problem = _assert_problem(await batches.api.get(f"/v1/batches/{batch_id}?{query}"), 422)
    assert problem["type"].endswith("/invalid-fields")
    assert problem["errors"][0]["field"].startswith("query.")


async def test_each_item_reaches_the_projection_with_its_batch_and_position(
    batches: Batches,
) -> None:
    """The status projection learns each item from its command (no `task.accepted` is
    published for a task sent now), with the batch and the item's position."""
    response = await batches.submit({"items": _items(12)})
    assert response.status_code == 202
    batch_id = response.json()["batch_id"]
    projected = batches.mongo[f"{batches.db_prefix}_status"]["tasks"]

    async def all_projected() -> dict[str, int] | None:
        documents = await projected.find({"batch_id": batch_id}).to_list()
        positions = {d["_id"]: d["batch_index"] for d in documents}
        return positions if len(positions) == 12 else None

    seen = await eventually(all_projected, what="12 items in the projection")
    order = [item["task_id"] for item in response.json()["items"]]
    assert [seen[task_id] for task_id in order] == list(range(12))
