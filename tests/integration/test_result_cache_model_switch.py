"""The result cache across a switch of `LLM_MODEL`: a completion fills its submission's key
only when the scorer asked for the model that key names (`task.completed`'s
`requested_model` against the submission's `cache_model`).

Tasks accepted before a switch and scored after it filled the old model's key with the new
model's results (and a gateway still defaulting to the old model keyed the new model's
results by the old name): later submissions for the old model were answered with another
model's score. An event without the field (a scorer of an earlier build) fills the key its
answer's model names, dated or not; a submission without the model (a gateway of an earlier
build) fills the cache as before.

The gateway's part runs `submit_score` and `settle_outcome` on the real database; the
scorer's, `score_text` against the fake model server; the last test runs both services on
the real broker.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from faststream.rabbit import RabbitBroker
from pymongo import AsyncMongoClient

from devtools.fake_llm import FakeLLM
from services.gateway.cache import ResultCache, scoring_model
from services.gateway.keys import generate_key
from services.gateway.refusals import Refusals
from services.gateway.schemas import ScoreSubmission
from services.gateway.settings import GatewaySettings
from services.gateway.submit import SubmitPolicy, Submitted, settle_outcome, submit_score
from services.scorer.decisions import Finish
from services.scorer.model import HeuristicModel, ScoringRequest
from services.scorer.model.settings import ModelSettings
from services.scorer.scoring import score_text
from shared.contracts import (
    HEURISTIC_PROMPT_VERSION,
    Phase,
    ScoreResult,
    ScoreText,
    TaskCompleted,
    TaskStatus,
    event_sequence,
    new_id,
)
from tests.integration.gateway_records import GatewayRecords, Recorded, gateway_records
from tests.integration.in_process import gateway_and_status, scorer_over
from tests.integration.scorer_parts import attempts_store, fake_model, scorer_deps
from tests.support import eventually, running, stack_env

pytestmark = pytest.mark.integration

NOW = datetime(2030, 1, 1, tzinfo=UTC)
TENANT = "tenant-a"
OLD_MODEL = "judge-1"  # the gateway's default (LLM_MODEL) when the submission was accepted
NEW_MODEL = "judge-2"  # what the scorers were switched to
RESULT = ScoreResult(score=8.5, comment="Scored by the new model.", model="judge-2-2030-01-01")
API_KEY = generate_key().token


@dataclass
class Gateway:
    records: GatewayRecords
    cache: ResultCache

    async def submit(self, text: str, *, default_model: str, model: str | None = None) -> Submitted:
        return await submit_score(
            ScoreSubmission.model_validate({"text": text, "model": model}),
            tenant_id=TENANT,
            idempotency_key=None,
            submissions=self.records.submissions,
            publisher=Recorded(self.records.broker),
            cache=self.cache,
            policy=SubmitPolicy(
                max_attempts=3, retention=timedelta(days=1), default_model=default_model
            ),
            clock=lambda: NOW,
            refusals=Refusals(),
        )

    async def complete(self, task_id: str, *, requested_model: str | None) -> None:
        """The task's `task.completed`, as a scorer that asked for `requested_model` sends it
        (None: a scorer that predates the field), settled by the gateway."""
        event = TaskCompleted(
            task_id=task_id,
            tenant_id=TENANT,
            attempt=1,
            submitted_at=NOW,
            sequence=event_sequence(generation=0, attempt=1, phase=Phase.TERMINAL),
            result=RESULT,
            requested_model=requested_model,
        )
        await settle_outcome(
            event, submissions=self.records.submissions, in_flight=None, cache=self.cache, now=NOW
        )

    async def cached_entries(self, task_id: str) -> int:
        found: int = await self.records.raw["result_cache"].count_documents({"task_id": task_id})
        return found


@pytest.fixture
async def gateway(mongo: Any, db_prefix: str, task_broker: RabbitBroker) -> AsyncIterator[Gateway]:
    async with gateway_records(mongo.url, db_prefix, task_broker) as records:
        cache = ResultCache(records.raw.client, records.name, timedelta(hours=1))
        await cache.ensure_indexes()
        try:
            yield Gateway(records, cache)
        finally:
            await records.raw.client.drop_database(records.name)


def _text() -> str:
    return f"An essay on model switches {uuid.uuid4().hex}."


async def test_a_completion_by_another_model_than_the_key_names_is_not_cached(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Accepted under the old default, scored by a scorer already switched: its result is
    not the old model's, so it answers no later submission for the old model. A warning
    names the settings to align: the gateway keyed by another default than the scorer's
    never fills the cache, and said so at debug only."""
    text = _text()
    first = await gateway.submit(text, default_model=OLD_MODEL)
    recorded = await gateway.records.raw["submissions"].find_one({"_id": first.task_id})
    assert recorded is not None
    assert recorded["cache_model"] == OLD_MODEL  # recorded with the key, in the same insert

    with caplog.at_level(logging.WARNING, logger="scorebox.gateway.cache"):
        await gateway.complete(first.task_id, requested_model=NEW_MODEL)

    [warning] = [each.getMessage() for each in caplog.records]
    assert f"task {first.task_id}, scored by {NEW_MODEL}, keyed by {OLD_MODEL}" in warning
    assert "LLM_PROVIDER and LLM_MODEL" in warning

    assert await gateway.cached_entries(first.task_id) == 0
    old_model = await gateway.submit(text, default_model=OLD_MODEL)
    assert (old_model.status, old_model.cached_result) == (TaskStatus.QUEUED, None)
    named_old = await gateway.submit(text, default_model=NEW_MODEL, model=OLD_MODEL)
    assert (named_old.status, named_old.cached_result) == (TaskStatus.QUEUED, None)


async def test_a_stale_default_does_not_key_the_new_models_results_by_the_old_name(
    gateway: Gateway,
) -> None:
    """A gateway still defaulting to the old model during a rolling switch keys a submission
    naming no model by the old name; the switched scorer's result is not cached under it."""
    text = _text()
    stale = await gateway.submit(text, default_model=OLD_MODEL)
    await gateway.complete(stale.task_id, requested_model=NEW_MODEL)

    again = await gateway.submit(text, default_model=OLD_MODEL)
    assert again.cached_result is None


async def test_a_completion_by_the_model_the_key_names_is_cached(gateway: Gateway) -> None:
    text = _text()
    first = await gateway.submit(text, default_model=NEW_MODEL)
    await gateway.complete(first.task_id, requested_model=NEW_MODEL)

    again = await gateway.submit(text, default_model=NEW_MODEL)
    assert again.status is TaskStatus.COMPLETED
    assert again.cached_result == RESULT.model_copy(update={"cached": True})
    # Named explicitly, the same model: the same key.
    named = await gateway.submit(text, default_model=OLD_MODEL, model=NEW_MODEL)
    assert named.cached_result == RESULT.model_copy(update={"cached": True})


async def test_a_completion_of_a_named_model_fills_that_models_key(gateway: Gateway) -> None:
    text = _text()
    first = await gateway.submit(text, default_model=OLD_MODEL, model="judge-3")
    await gateway.complete(first.task_id, requested_model="judge-3")

    assert (await gateway.submit(text, default_model=OLD_MODEL)).cached_result is None
    named = await gateway.submit(text, default_model=NEW_MODEL, model="judge-3")
    assert named.status is TaskStatus.COMPLETED


async def test_a_completion_that_does_not_say_its_model_fills_the_key_its_answer_names(
    gateway: Gateway,
) -> None:
    """A scorer of an earlier build, during a rolling upgrade: the provider's answer names
    the key's model with its snapshot's date (`judge-2-2030-01-01`), and it is cached."""
    text = _text()
    first = await gateway.submit(text, default_model=NEW_MODEL)
    await gateway.complete(first.task_id, requested_model=None)

    again = await gateway.submit(text, default_model=NEW_MODEL)
    assert again.cached_result == RESULT.model_copy(update={"cached": True})


async def test_a_completion_that_does_not_say_its_model_fills_no_other_models_key(
    gateway: Gateway, caplog: pytest.LogCaptureFixture
) -> None:
    """Taken as the key's model, an earlier build's completion of another provider (or
    model) filled the key with its results during a rolling upgrade."""
    text = _text()
    first = await gateway.submit(text, default_model=OLD_MODEL)
    with caplog.at_level(logging.WARNING, logger="scorebox.gateway.cache"):
        await gateway.complete(first.task_id, requested_model=None)

    assert await gateway.cached_entries(first.task_id) == 0
    assert (await gateway.submit(text, default_model=OLD_MODEL)).cached_result is None
    [warning] = [each.getMessage() for each in caplog.records]
    assert f"scored by {RESULT.model}, keyed by {OLD_MODEL}" in warning


async def test_a_submission_recorded_without_its_model_still_fills_the_cache(
    gateway: Gateway,
) -> None:
    """A submission a gateway of an earlier build accepted (no `cache_model`): as before."""
    text = _text()
    first = await gateway.submit(text, default_model=OLD_MODEL)
    await gateway.records.raw["submissions"].update_one(
        {"_id": first.task_id}, {"$unset": {"cache_model": ""}}
    )
    await gateway.complete(first.task_id, requested_model=NEW_MODEL)

    assert await gateway.cached_entries(first.task_id) == 1


def _command(*, model: str | None = None) -> ScoreText:
    return ScoreText(
        task_id=new_id(), text=f"An essay [[id:m{uuid.uuid4().hex[:12]}]].", model=model
    )


@pytest.mark.parametrize(("named", "asked_for"), [(None, "fake-judge-1"), ("judge-x", "judge-x")])
async def test_the_scorers_completion_says_which_model_it_asked_for(
    fake_llm: FakeLLM, mongo: Any, db_prefix: str, named: str | None, asked_for: str
) -> None:
    """The configured `LLM_MODEL` (`scorer_parts.fake_model`: fake-judge-1), or the model the
    command names; not the provider's dated answer."""
    async with fake_model(fake_llm) as model, attempts_store(mongo.url, db_prefix) as attempts:
        decision = await score_text(
            _command(model=named), deps=scorer_deps(attempts=attempts, model=model)
        )
    assert isinstance(decision, Finish)
    assert isinstance(decision.event, TaskCompleted)
    assert decision.event.requested_model == asked_for
    assert decision.event.result.model != asked_for  # the fake answers a dated name
    assert TaskCompleted.model_validate_json(decision.event.model_dump_json()) == decision.event


@pytest.mark.parametrize("named", [None, "gpt-4o-mini"])
async def test_the_heuristic_asks_for_itself_whatever_a_submission_names(
    named: str | None,
) -> None:
    """As `scoring_model` keys a submission while the heuristic is the provider."""
    verdict = await HeuristicModel().score(
        ScoringRequest(task_id=new_id(), text="A short essay.", model=named)
    )
    assert verdict.requested_model == HEURISTIC_PROMPT_VERSION
    assert verdict.requested_model == scoring_model(named, HEURISTIC_PROMPT_VERSION)


async def test_a_task_accepted_before_a_switch_and_scored_after_it_is_not_cached(
    fake_llm: FakeLLM, amqp_url: str, mongo: Any, db_prefix: str
) -> None:
    """End to end on the broker: a gateway still on the old `LLM_MODEL`, a scorer switched.
    The task it accepted is scored by the new model and answers no later submission for
    the old one; one naming the new model fills that model's key."""
    env = stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        llm_url=fake_llm.url,
        api_key=API_KEY,
        LLM_MODEL=OLD_MODEL,
    )
    scorer = scorer_over(
        fake_llm, amqp_url=amqp_url, mongo_url=mongo.url, db_prefix=db_prefix, LLM_MODEL=NEW_MODEL
    )
    text = f"Scored across a switch [[id:e{uuid.uuid4().hex[:12]}]]."
    client: AsyncMongoClient[dict[str, Any]] = AsyncMongoClient(mongo.url, tz_aware=True)
    cache = client[f"{db_prefix}_gateway"]["result_cache"]
    try:
        async with running(scorer.app()), gateway_and_status(env, api_key=API_KEY) as services:
            api = services.api
            before = await _scored(api, {"text": text})
            after = await _scored(api, {"text": text, "model": NEW_MODEL})

            async def new_model_cached() -> bool:
                return await cache.count_documents({"task_id": after}) == 1

            # The gateway handled the later outcome; the earlier one left nothing.
            await eventually(new_model_cached, what="the new model's result cached")
            assert await cache.count_documents({"task_id": before}) == 0
            old_model = await api.post("/v1/scores", json={"text": text})
            assert old_model.status_code == 202, old_model.text
            new_model = await api.post("/v1/scores", json={"text": text, "model": NEW_MODEL})
            assert new_model.status_code == 200, new_model.text
            assert new_model.json()["result"]["cached"] is True

            # A batch's items the same way.
            other = f"A batch across a switch [[id:e{uuid.uuid4().hex[:12]}]]."
            items = [{"text": other}, {"text": other, "model": NEW_MODEL}]
            batch = await api.post("/v1/batches", json={"items": items})
            assert batch.status_code == 202, batch.text
            defaulted, named = (item["task_id"] for item in batch.json()["items"])

            async def named_item_cached() -> bool:
                return await cache.count_documents({"task_id": named}) == 1

            await eventually(named_item_cached, what="the batch item naming the new model cached")
            await _completed(api, defaulted)
            assert await cache.count_documents({"task_id": defaulted}) == 0
    finally:
        await client.close()


async def _scored(api: httpx.AsyncClient, body: dict[str, Any]) -> str:
    """Submit `body` (no cache hit expected) and wait until its task completed."""
    response = await api.post("/v1/scores", json=body)
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    await _completed(api, task_id)
    return task_id


async def _completed(api: httpx.AsyncClient, task_id: str) -> None:
    async def completed() -> bool:
        view = (await api.get(f"/v1/scores/{task_id}")).json()
        assert view["status"] != "failed", view
        return bool(view["status"] == "completed")

    await eventually(completed, timeout_s=60, what=f"task {task_id} completed")


@pytest.mark.parametrize("configured", ["judge-1 ", "\tjudge-1\n", "  "])
def test_the_gateway_and_the_scorer_read_llm_model_alike(configured: str) -> None:
    """The gateway stripped `LLM_MODEL` for its key and the scorer asked for it as it stood:
    with a stray blank from an env file on both, every completion was a mismatch, never
    cached (found in review)."""
    gateway = GatewaySettings.model_validate({"LLM_PROVIDER": "openai", "LLM_MODEL": configured})
    scorer = ModelSettings.model_validate(
        {"LLM_PROVIDER": "openai", "LLM_MODEL": configured, "LLM_API_KEY": "k"}
    )
    assert gateway.default_model == scorer.llm_model
