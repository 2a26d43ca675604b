"""Re-scoring in-process — gateway, scorer, status — on the real broker and database with the
fake model: a `RescoreTask` (as the scheduler's fan-out sends it) queues a completed task
again as its next generation, once per rubric version, and leaves unknown tasks alone."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import datetime
from typing import Any

import aio_pika
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
from shared.bus import publish_delayed
from shared.contracts import DEFAULT_TENANT, HEURISTIC_PROMPT_VERSION, RescoreTask, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import RESCORE_REQUESTS, SCORE_REQUESTS, TASKS
from tests.support import drain, eventually, running, stack_env

API_KEY = generate_key().token  # registered for the default tenant by BOOTSTRAP_API_KEY
ADMIN_KEY = "rescore-admin-key"
GENERATION_SPAN = 1_000_000  # `shared.contracts.event_sequence`: generation * span + ...
RESCORE_LOGGER = "scorebox.gateway.rescore"

Mongo = AsyncMongoClient[dict[str, Any]]


@dataclass
class Flow:
    api: httpx.AsyncClient
    status: httpx.AsyncClient
    llm: FakeLLM
    amqp_url: str
    submissions: Any
    cache: Any  # the gateway's result cache

    async def submit(self, text: str) -> str:
        response = await self.api.post("/v1/scores", json={"text": text})
        assert response.status_code == 202, response.text
        task_id: str = response.json()["task_id"]
        return task_id

    async def view(self, task_id: str) -> dict[str, Any]:
        body: dict[str, Any] = (await self.api.get(f"/v1/scores/{task_id}")).json()
        return body

    async def completed_generation(self, task_id: str, generation: int) -> dict[str, Any]:
        """The task's view once it completed as `generation` (or a later one)."""

        async def completed() -> dict[str, Any] | None:
            view = await self.view(task_id)
            done = view.get("status") == "completed"
            return view if done and view["sequence"] >= generation * GENERATION_SPAN else None

        return await eventually(
            completed, timeout_s=60, what=f"task {task_id} completed as generation {generation}"
        )

    async def history(self, task_id: str, after: int) -> list[tuple[int, str]]:
        response = await self.status.get(
            f"/internal/v1/tasks/{task_id}/history",
            params={"tenant_id": DEFAULT_TENANT, "after": after},
        )
        assert response.status_code == 200, response.text
        return [(change["sequence"], change["status"]) for change in response.json()["changes"]]

    def calls(self, marker: str) -> int:
        return int(self.llm.stats()["by_id"].get(marker, 0))

    async def dead_lettered(self, task_id: str) -> None:
        """Wait until the task failed for good, its command in the dead-letter queue."""

        async def failed_for_good() -> bool:
            view = await self.view(task_id)
            return view["status"] == "failed" and bool(view["error"]["dead_lettered"])

        await eventually(failed_for_good, timeout_s=60, what=f"{task_id} dead-lettered")

    async def request_rescores(self, *requests: RescoreTask) -> None:
        broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": self.amqp_url}))
        async with broker:
            await broker.connect()
            for request in requests:
                await publish_delayed(
                    broker,
                    request,
                    exchange=TASKS,
                    routing_key=request.routing_key,
                    not_before=None,
                    now=utcnow(),
                    timeout=10,
                )

    async def publish_raw(self, body: bytes) -> None:
        broker = make_broker(ScorerSettings.model_validate({"RABBITMQ_URL": self.amqp_url}))
        async with broker:
            await broker.connect()
            await broker.publish(body, exchange=TASKS, routing_key="score.rescore", timeout=10)


@pytest.fixture(scope="module")
async def flow(amqp_url: str, mongo: Any, db_prefix: str) -> AsyncIterator[Flow]:
    llm = await start_fake_llm(FakeLLMConfig())
    env = stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_url=llm.url,
        api_key=API_KEY,
        admin_key=ADMIN_KEY,
        llm_timeout_s=10,  # no hang here: a slow answer (2 s) must never time out
        SCORER_STARTED_AFTER_S="0",  # every attempt announces `processing`
    )
    scorer = create_scorer(ScorerSettings.model_validate(env), ModelSettings.model_validate(env))
    status = create_status(StatusSettings.model_validate(env))
    client: Mongo = AsyncMongoClient(mongo.url, tz_aware=True)
    async with running(status) as status_client, running(scorer):
        gateway = create_gateway(GatewaySettings.model_validate(env), status_http=status_client)
        async with running(gateway) as api:
            api.headers["Authorization"] = f"Bearer {API_KEY}"
            database = client[f"{db_prefix}_gateway"]
            yield Flow(
                api, status_client, llm, amqp_url, database["submissions"], database["result_cache"]
            )
    await client.close()
    await llm.stop()


@pytest.fixture
def rescore_log(caplog: pytest.LogCaptureFixture) -> pytest.LogCaptureFixture:
    caplog.set_level(logging.INFO, logger=RESCORE_LOGGER)
    return caplog


def _marker() -> str:
    return f"t{uuid.uuid4().hex[:12]}"


def _rescore(
    task_id: str,
    *,
    tenant_id: str = DEFAULT_TENANT,
    version: str = "v2",
    generation: int | None = None,
    answered_from_cache: bool = False,
) -> RescoreTask:
    return RescoreTask.for_task(
        task_id=task_id,
        tenant_id=tenant_id,
        rubric_version=version,
        previous_rubric_version=None,
        model="fake-judge-1",
        run_id=new_id(),
        generation=generation,
        answered_from_cache=answered_from_cache,
    )


async def _handled(caplog: pytest.LogCaptureFixture, task_id: str, count: int) -> list[str]:
    """The rescore log lines about `task_id`, once there are `count` of them."""

    async def logged() -> list[str] | None:
        lines = [
            record.getMessage()
            for record in caplog.records
            if record.name == RESCORE_LOGGER and task_id in record.getMessage()
        ]
        return lines if len(lines) >= count else None

    return await eventually(logged, what=f"{count} re-score request(s) for {task_id} handled")


async def _dead_letters(amqp_url: str) -> list[aio_pika.abc.AbstractIncomingMessage]:
    return await drain(amqp_url, RESCORE_REQUESTS.dead_letter_routing_key)


async def test_a_rescore_queues_the_task_again_once_and_shows_the_new_result(
    flow: Flow, rescore_log: pytest.LogCaptureFixture
) -> None:
    marker = _marker()
    task_id = await flow.submit(f"An essay to score again [[id:{marker}]].")
    first = await flow.completed_generation(task_id, 0)
    assert flow.calls(marker) == 1
    stored = await flow.submissions.find_one({"_id": task_id})
    assert stored["state"] == "accepted"
    assert stored["command"]["text"].startswith("An essay to score again")  # the text is kept

    request = _rescore(task_id)
    await flow.request_rescores(request, request)  # the second one is a duplicate

    again = await flow.completed_generation(task_id, 1)
    assert again["result"] is not None
    assert again["sequence"] > first["sequence"]
    assert datetime.fromisoformat(again["updated_at"]) > datetime.fromisoformat(first["updated_at"])
    # Queued again, then scored again, all as generation 1.
    changes = await flow.history(task_id, after=first["sequence"])
    assert [status for _, status in changes] == ["queued", "processing", "completed"]
    assert all(sequence // GENERATION_SPAN == 1 for sequence, _ in changes)

    lines = await _handled(rescore_log, task_id, 2)
    assert sum("queued as generation 1" in line for line in lines) == 1
    assert sum("ignored: a duplicate request" in line for line in lines) == 1
    stored = await flow.submissions.find_one({"_id": task_id})
    assert stored["generation"] == 1
    assert stored["rescored_for"] == ["v2"]
    assert stored["rescore"]["sent"] is True
    assert stored["state"] == "accepted"
    assert flow.calls(marker) == 2
    assert (await flow.view(task_id))["sequence"] == again["sequence"]


async def test_a_new_rubric_version_scores_the_task_again(
    flow: Flow, rescore_log: pytest.LogCaptureFixture
) -> None:
    marker = _marker()
    task_id = await flow.submit(f"Scored under three rubrics [[id:{marker}]].")
    await flow.completed_generation(task_id, 0)
    await flow.request_rescores(_rescore(task_id, version="v2"))
    await flow.completed_generation(task_id, 1)
    await flow.request_rescores(_rescore(task_id, version="v3"))
    await flow.completed_generation(task_id, 2)
    await flow.request_rescores(_rescore(task_id, version="v2"))  # a late request of v2
    await _handled(rescore_log, task_id, 3)
    stored = await flow.submissions.find_one({"_id": task_id})
    assert stored["generation"] == 2
    assert flow.calls(marker) == 3


async def test_a_version_switched_back_to_is_scored_again_and_a_stale_request_is_not(
    flow: Flow, rescore_log: pytest.LogCaptureFixture
) -> None:
    """A fan-out names the generation it found completed: v2, then v3, then v2 again (a
    rubric rolled back) is scored each time. Once per version, the third was refused as a
    duplicate and the task kept v3's result, though the fan-out counted it sent (a
    walkthrough). A request of a generation no longer the latest (late, or a duplicate) is
    refused."""
    marker = _marker()
    task_id = await flow.submit(f"Scored, rolled forward and back [[id:{marker}]].")
    await flow.completed_generation(task_id, 0)
    await flow.request_rescores(_rescore(task_id, version="v2", generation=0))
    await flow.completed_generation(task_id, 1)
    await flow.request_rescores(_rescore(task_id, version="v3", generation=1))
    await flow.completed_generation(task_id, 2)
    back = _rescore(task_id, version="v2", generation=2)
    await flow.request_rescores(back, back)  # the second one is a duplicate
    await flow.completed_generation(task_id, 3)
    await flow.request_rescores(_rescore(task_id, version="v3", generation=1))  # a late one

    lines = await _handled(rescore_log, task_id, 5)
    assert sum("ignored: a duplicate request" in line for line in lines) == 2
    stored = await flow.submissions.find_one({"_id": task_id})
    assert stored["generation"] == 3
    assert stored["rescore"]["rubric_version"] == "v2"
    assert flow.calls(marker) == 4


async def test_a_generation_that_failed_since_does_not_hold_the_next_versions_rescore(
    flow: Flow, rescore_log: pytest.LogCaptureFixture
) -> None:
    """The catalogue knows completions only: after a re-score that failed (its generation
    finished, not completed), the next version's request names the generation that last
    completed, and is taken; it was refused for good as a duplicate (a review)."""
    marker = _marker()
    task_id = await flow.submit(f"Re-scored, then a re-score failed [[id:{marker}]].")
    await flow.completed_generation(task_id, 0)
    await flow.request_rescores(_rescore(task_id, version="v2", generation=0))
    await flow.completed_generation(task_id, 1)
    await flow.submissions.update_one(  # generation 2 handed out, and failed
        {"_id": task_id}, {"$set": {"generation": 2, "finished_generation": 2}}
    )
    await flow.request_rescores(_rescore(task_id, version="v3", generation=1))

    await flow.completed_generation(task_id, 3)
    lines = await _handled(rescore_log, task_id, 2)
    assert sum("queued as generation 3" in line for line in lines) == 1


async def _answered_from_the_cache(flow: Flow, text: str) -> tuple[str, str, str]:
    """A task scored, and a copy of its text the cache answered, both as generation 0, the
    cache's entry then of another rubric version, one the gateway keeps (as after a change
    of the prompt): their ids, and the version results carry now."""
    scored = await flow.submit(text)
    first = await flow.completed_generation(scored, 0)
    copy = await flow.api.post("/v1/scores", json={"text": text})
    assert copy.status_code == 200, copy.text
    assert copy.json()["result"]["cached"] is True
    version: str = first["result"]["prompt_version"]
    assert version != HEURISTIC_PROMPT_VERSION  # scored by the model, not the offline scorer
    changed = await flow.cache.update_one(
        {"task_id": scored}, {"$set": {"result.prompt_version": HEURISTIC_PROMPT_VERSION}}
    )
    assert changed.modified_count == 1
    return scored, copy.json()["task_id"], version


async def test_a_task_the_cache_answered_is_answered_from_it_again_once_its_text_is_rescored(
    flow: Flow, rescore_log: pytest.LogCaptureFixture
) -> None:
    """Each task the cache answered made a model call of its own at a rubric change, where
    the submissions cost one (a review in session 54). Its request, sent after the others,
    finds the text scored under the new version by then, and is answered from the cache."""
    marker = _marker()
    text = f"Scored once, answered from the cache since [[id:{marker}]]."
    scored, copy, version = await _answered_from_the_cache(flow, text)

    await flow.request_rescores(_rescore(scored, version=version, generation=0))
    rescored = await flow.completed_generation(scored, 1)

    async def cached_under_the_new_version() -> bool:
        entry = await flow.cache.find_one({"task_id": scored})
        return entry is not None and entry["result"]["prompt_version"] == version

    await eventually(cached_under_the_new_version, what="the new result cached")
    await flow.request_rescores(
        _rescore(copy, version=version, generation=0, answered_from_cache=True)
    )

    answered = await flow.completed_generation(copy, 1)
    assert answered["result"]["cached"] is True
    assert answered["result"]["score"] == rescored["result"]["score"]
    assert answered["result"]["prompt_version"] == version
    changes = await flow.history(copy, after=GENERATION_SPAN - 1)
    assert [status for _, status in changes] == ["queued", "completed"]
    assert all(sequence // GENERATION_SPAN == 1 for sequence, _ in changes)
    [line] = await _handled(rescore_log, copy, 1)
    assert "answered from the result cache as generation 1" in line
    stored = await flow.submissions.find_one({"_id": copy})
    assert stored["rescore"]["sent"] is True
    assert stored["rescore"]["answer"]["cached"]["score"] == rescored["result"]["score"]
    assert flow.calls(marker) == 2  # the scored task's two calls; none for the copy


async def test_a_task_the_cache_answered_is_scored_when_its_text_was_not_rescored_yet(
    flow: Flow, rescore_log: pytest.LogCaptureFixture
) -> None:
    """The cache holds the text's result of the earlier version only: the copy is scored
    under the new one, as before."""
    marker = _marker()
    text = f"Answered from the cache, its text not scored again yet [[id:{marker}]]."
    _, copy, version = await _answered_from_the_cache(flow, text)

    await flow.request_rescores(
        _rescore(copy, version=version, generation=0, answered_from_cache=True)
    )

    scored_again = await flow.completed_generation(copy, 1)
    assert scored_again["result"]["cached"] is False
    assert flow.calls(marker) == 2
    [line] = await _handled(rescore_log, copy, 1)
    assert "queued as generation 1" in line
    stored = await flow.submissions.find_one({"_id": copy})
    assert stored["rescore"]["answer"] == {"cached": None}


async def test_a_rescore_of_an_unknown_or_foreign_task_changes_nothing(
    flow: Flow, rescore_log: pytest.LogCaptureFixture
) -> None:
    await _dead_letters(flow.amqp_url)
    marker = _marker()
    task_id = await flow.submit(f"Mine alone [[id:{marker}]].")
    first = await flow.completed_generation(task_id, 0)
    unknown = new_id()

    await flow.request_rescores(_rescore(unknown), _rescore(task_id, tenant_id="someone-else"))

    [unknown_line] = await _handled(rescore_log, unknown, 1)
    assert "no such submission" in unknown_line
    [foreign_line] = await _handled(rescore_log, task_id, 1)
    assert "no such submission" in foreign_line
    assert (await flow.api.get(f"/v1/scores/{unknown}")).status_code == 404
    assert await flow.submissions.find_one({"_id": unknown}) is None
    stored = await flow.submissions.find_one({"_id": task_id})
    assert stored.get("generation", 0) == 0
    assert "rescore" not in stored
    assert (await flow.view(task_id))["sequence"] == first["sequence"]
    assert flow.calls(marker) == 1
    assert await _dead_letters(flow.amqp_url) == []  # acknowledged, not dead-lettered


async def test_a_rescore_of_a_task_whose_text_is_gone_is_ignored(
    flow: Flow, rescore_log: pytest.LogCaptureFixture
) -> None:
    marker = _marker()
    task_id = await flow.submit(f"Accepted before texts were kept [[id:{marker}]].")
    await flow.completed_generation(task_id, 0)
    await flow.submissions.update_one({"_id": task_id}, {"$unset": {"command": ""}})

    await flow.request_rescores(_rescore(task_id))

    [line] = await _handled(rescore_log, task_id, 1)
    assert "text was not kept" in line
    assert (await flow.submissions.find_one({"_id": task_id})).get("generation", 0) == 0
    assert flow.calls(marker) == 1


async def test_an_unreadable_rescore_request_is_dead_lettered(flow: Flow) -> None:
    await _dead_letters(flow.amqp_url)
    await flow.publish_raw(b'{"not": "a rescore request"}')

    async def dead_lettered() -> list[aio_pika.abc.AbstractIncomingMessage] | None:
        return await _dead_letters(flow.amqp_url) or None

    [letter] = await eventually(dead_lettered, what="the unreadable request in the DLQ")
    assert b"a rescore request" in letter.body
    # The consumer lives on.
    marker = _marker()
    task_id = await flow.submit(f"Still rescored [[id:{marker}]].")
    await flow.completed_generation(task_id, 0)
    await flow.request_rescores(_rescore(task_id))
    await flow.completed_generation(task_id, 1)
    assert flow.calls(marker) == 2


async def test_a_rescore_after_a_dead_letter_replay_takes_the_next_generation(flow: Flow) -> None:
    marker = _marker()
    task_id = await flow.submit(f"Failed four times, then fine [[id:{marker}]] [[fake:500x4]]")

    await flow.dead_lettered(task_id)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    replay = await flow.api.post(
        "/admin/v1/dead-letters/replay", json={"ids": [task_id]}, headers=admin
    )
    assert replay.json()["replayed"] == [task_id]
    await flow.completed_generation(task_id, 1)

    async def generation_noted() -> bool:
        stored = await flow.submissions.find_one({"_id": task_id})
        return stored is not None and stored.get("generation") == 1

    await eventually(generation_noted, what="the replay's generation noted on the submission")
    await flow.request_rescores(_rescore(task_id, version="v2"))
    await flow.completed_generation(task_id, 2)
    assert flow.calls(marker) == 6  # 4 failures, the replay, the re-score


async def test_a_rescore_racing_a_dead_letter_replay_takes_a_generation_of_its_own(
    flow: Flow,
) -> None:
    """The replay takes its generation from the submission, as a re-score does. It used to
    send the dead letter's generation + 1 and leave the submission behind until the replay's
    outcome arrived: a re-score requested meanwhile took the same generation, which the
    scorer treated as the replay's (the re-score never ran)."""
    marker = _marker()
    task_id = await flow.submit(
        f"Failed four times, then slow [[id:{marker}]] [[fake:500x4]][[fake:slow]]"
    )

    await flow.dead_lettered(task_id)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    replay = await flow.api.post(
        "/admin/v1/dead-letters/replay", json={"ids": [task_id]}, headers=admin
    )
    assert replay.json()["replayed"] == [task_id]
    stored = await flow.submissions.find_one({"_id": task_id})
    assert stored is not None
    assert stored.get("generation") == 1  # taken by the replay, its (slow) outcome still to come

    await flow.request_rescores(_rescore(task_id, version="v2"))
    await flow.completed_generation(task_id, 2)
    assert flow.calls(marker) == 6  # 4 failures, the replay, the re-score


async def _copy_the_dead_letter(amqp_url: str) -> None:
    """Put a second copy of the score queue's only dead letter beside it, as a dead letter
    sent again (its confirm lost) or a redelivery dead-lettering a recorded failure do."""
    connection = await aio_pika.connect(amqp_url, timeout=10)
    async with connection:
        channel = await connection.channel(publisher_confirms=True)
        queue = await channel.get_queue(SCORE_REQUESTS.dead_letter_routing_key, ensure=True)
        letter = await queue.get(no_ack=False, timeout=5)
        copy = aio_pika.Message(
            letter.body,
            headers=dict(letter.headers),
            message_id=letter.message_id,
            correlation_id=letter.correlation_id,
            delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        )
        await channel.default_exchange.publish(copy, routing_key=queue.name, timeout=10)
        await letter.nack(requeue=True)


async def test_two_copies_of_a_dead_letter_replay_as_one_generation(flow: Flow) -> None:
    """Each copy used to take a generation of its own from the submission: the task was
    scored twice (two calls, two outcomes, two callbacks)."""
    marker = _marker()
    task_id = await flow.submit(f"Dead-lettered, copied [[id:{marker}]] [[fake:500x4]]")

    await flow.dead_lettered(task_id)
    await _copy_the_dead_letter(flow.amqp_url)
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    replay = await flow.api.post(
        "/admin/v1/dead-letters/replay", json={"ids": [task_id]}, headers=admin
    )
    assert replay.json()["replayed"] == [task_id, task_id]
    stored = await flow.submissions.find_one({"_id": task_id})
    assert stored is not None
    assert stored.get("generation") == 1  # one generation taken for both copies
    await flow.completed_generation(task_id, 1)
    assert flow.calls(marker) == 5  # 4 failures, then the replay (once)
