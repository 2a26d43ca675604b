"""Chat completions that hold no verdict: no choice at all, or an answer cut at the token limit.

A chat completion without a choice comes from a chat-completions endpoint all the same:
refused when Azure OpenAI's prompt filter says it stopped the text, else retried (a proxy's
glitch), never taken for a misconfigured LLM_BASE_URL. An answer cut at the token limit is
repaired once, as any unusable answer (the repair asks for the JSON object alone, which fits
where a verbose answer did not); still unusable, the failure names the setting that raises
the limit. Each bills what it reports. A
scripted HTTP server plays the provider; the fake model server then plays it for real.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest

from devtools.fake_llm import FakeLLM, FakeLLMConfig, start_fake_llm
from services.scorer.errors import (
    InputRejected,
    ModelMisconfigured,
    ModelRateLimited,
    ModelUnavailable,
    ScoringError,
    UnusableOutput,
)
from services.scorer.model import OpenAIChatModel, ScoringRequest, make_http_client
from shared.contracts import Usage
from tests.unit.test_model_openai import (
    GOOD,
    Answer,
    ScriptedProvider,
    completion,
    json_answer,
    request,
    score_with,
    settings,
)

ANSWERED_MODEL = "gpt-4o-mini-2024-07-18"
BILLED = {"prompt_tokens": 90, "completion_tokens": 0, "total_tokens": 90}
MAX_OUTPUT_TOKENS = 300  # `settings()`'s LLM_MAX_OUTPUT_TOKENS


def finished(content: Any, finish_reason: str, *, completion_tokens: int = 300) -> Answer:
    """A chat completion of one choice that ended for `finish_reason`."""
    return json_answer(
        200,
        {
            "object": "chat.completion",
            "model": ANSWERED_MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": content},
                    "finish_reason": finish_reason,
                }
            ],
            "usage": {"prompt_tokens": 120, "completion_tokens": completion_tokens},
        },
    )


def without_choices(**fields: Any) -> Answer:
    """An Azure OpenAI chat completion without a choice; `fields` replace or add members
    (None removes one)."""
    body = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "model": ANSWERED_MODEL,
        "choices": [],
        "usage": BILLED,
        **fields,
    }
    return json_answer(200, {key: value for key, value in body.items() if value is not None})


def prompt_filter(**categories: Any) -> list[dict[str, Any]]:
    """Azure OpenAI's `prompt_filter_results`: every category unfiltered but `categories`."""
    verdicts: dict[str, Any] = {
        "hate": {"filtered": False, "severity": "safe"},
        "self_harm": {"filtered": False, "severity": "safe"},
        "sexual": {"filtered": False, "severity": "safe"},
        "violence": {"filtered": False, "severity": "safe"},
        "jailbreak": {"filtered": False, "detected": False},
        **categories,
    }
    return [{"prompt_index": 0, "content_filter_results": verdicts}]


async def raised_by(provider: ScriptedProvider) -> ScoringError:
    with pytest.raises(ScoringError) as caught:
        await score_with(provider)
    return caught.value


# --- no choice -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "answer",
    [
        pytest.param(without_choices(), id="empty-choices"),
        pytest.param(without_choices(object=None), id="empty-choices-no-object"),
        pytest.param(without_choices(choices=None), id="no-choices-member"),
        pytest.param(without_choices(prompt_filter_results=prompt_filter()), id="filter-passed"),
    ],
)
async def test_a_chat_completion_without_a_choice_is_retried_and_billed(answer: Answer) -> None:
    provider = ScriptedProvider(answer)
    error = await raised_by(provider)
    assert isinstance(error, ModelUnavailable)
    assert not error.provider_down  # it answered: no outage's
    assert error.to_task_error().code == "model_unavailable"
    assert error.retryable
    assert "chat completion without any choice" in error.message
    assert error.usage == Usage(prompt_tokens=90)
    assert error.model == ANSWERED_MODEL
    assert len(provider.requests) == 1


async def test_a_chat_completion_without_a_choice_or_usage_bills_nothing() -> None:
    error = await raised_by(ScriptedProvider(without_choices(usage=None, model=None)))
    assert isinstance(error, ModelUnavailable)
    assert (error.usage, error.model) == (None, None)


async def test_without_its_model_the_billed_answer_is_the_requested_models() -> None:
    error = await raised_by(ScriptedProvider(without_choices(model=None)))
    assert (error.usage, error.model) == (Usage(prompt_tokens=90), "gpt-4o-mini")


@pytest.mark.parametrize(
    ("categories", "named"),
    [
        pytest.param(
            {"hate": {"filtered": True, "severity": "high"}, "jailbreak": {"filtered": True}},
            "hate, jailbreak",
            id="categories",
        ),
        pytest.param(
            {"custom_blocklists": {"filtered": True, "details": [{"id": "words"}]}},
            "custom_blocklists",
            id="blocklist",
        ),
        pytest.param(
            {"custom_blocklists": [{"filtered": False, "id": "a"}, {"filtered": True, "id": "b"}]},
            "custom_blocklists",
            id="blocklist-as-a-list",
        ),
    ],
)
async def test_a_prompt_the_providers_filter_stopped_is_input_rejected_and_billed(
    categories: dict[str, Any], named: str
) -> None:
    """Azure OpenAI: no choice, and `prompt_filter_results` says which categories stopped it."""
    provider = ScriptedProvider(without_choices(prompt_filter_results=prompt_filter(**categories)))
    error = await raised_by(provider)
    assert isinstance(error, InputRejected)
    assert error.to_task_error().code == "input_rejected"
    assert not error.retryable
    assert error.message == f"the provider's content filter stopped the prompt: {named}"
    assert error.usage == Usage(prompt_tokens=90)
    assert error.model == ANSWERED_MODEL
    assert len(provider.requests) == 1


async def test_an_error_in_a_choiceless_body_is_read_first() -> None:
    body = {"object": "chat.completion", "choices": [], "error": {"code": 429, "message": "wait"}}
    error = await raised_by(ScriptedProvider(json_answer(200, body)))
    assert isinstance(error, ModelRateLimited)


async def test_a_repair_answered_without_a_choice_bills_both_answers() -> None:
    provider = ScriptedProvider(
        completion("Seven out of ten.", prompt_tokens=100, completion_tokens=10),
        without_choices(),
    )
    error = await raised_by(provider)
    assert isinstance(error, ModelUnavailable)
    assert error.usage == Usage(prompt_tokens=190, completion_tokens=10)
    assert len(provider.requests) == 2


# --- cut at the token limit ------------------------------------------------------------------


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(None, id="null"),
        pytest.param("", id="empty"),
        pytest.param('{"score": 7, "comment": "Clear, well argued and', id="half-a-verdict"),
    ],
)
async def test_an_answer_cut_at_the_token_limit_is_repaired(content: str | None) -> None:
    provider = ScriptedProvider(
        finished(content, "length"), finished(GOOD, "stop", completion_tokens=20)
    )
    verdict = await score_with(provider)
    assert verdict.result.score == 7.5
    assert verdict.result.usage == Usage(prompt_tokens=240, completion_tokens=320)
    assert len(provider.requests) == 2


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(None, id="null"),
        pytest.param('{"score": 7, "comment": "Clear, well argued and', id="half-a-verdict"),
    ],
)
@pytest.mark.parametrize(
    "repair",
    [
        pytest.param(("Seven.", "stop"), id="repair-unusable"),
        pytest.param((None, "length"), id="repair-cut-too"),
    ],
)
async def test_an_answer_cut_and_still_unusable_after_its_repair_names_the_setting(
    content: str | None, repair: tuple[str | None, str]
) -> None:
    provider = ScriptedProvider(finished(content, "length"), finished(*repair))
    error = await raised_by(provider)
    assert isinstance(error, UnusableOutput)
    assert error.to_task_error().code == "unusable_output"
    assert not error.retryable
    assert error.message == (
        "still unusable after one repair attempt: the model stopped at its token limit "
        f"({MAX_OUTPUT_TOKENS} tokens) before a complete answer; LLM_MAX_OUTPUT_TOKENS raises it"
    )
    assert error.raw_output == (repair[0] or "")
    assert error.usage == Usage(prompt_tokens=240, completion_tokens=600)
    assert error.model == ANSWERED_MODEL
    assert len(provider.requests) == 2


async def test_a_verdict_complete_at_the_token_limit_is_accepted() -> None:
    provider = ScriptedProvider(finished(GOOD, "length", completion_tokens=20))
    verdict = await score_with(provider)
    assert verdict.result.score == 7.5
    assert verdict.result.flags == []
    assert len(provider.requests) == 1


async def test_a_repair_cut_at_the_token_limit_names_the_setting_and_bills_both() -> None:
    provider = ScriptedProvider(
        completion("Seven out of ten.", prompt_tokens=100, completion_tokens=10),
        finished(None, "length"),
    )
    error = await raised_by(provider)
    assert isinstance(error, UnusableOutput)
    assert "LLM_MAX_OUTPUT_TOKENS raises it" in error.message
    assert error.usage == Usage(prompt_tokens=220, completion_tokens=310)
    assert len(provider.requests) == 2


async def test_no_content_after_a_stop_is_repaired_then_unusable() -> None:
    """Not cut short: a model that answered nothing may answer when told, so it is repaired."""
    provider = ScriptedProvider(
        finished(None, "stop", completion_tokens=1), finished(None, "stop", completion_tokens=1)
    )
    error = await raised_by(provider)
    assert isinstance(error, UnusableOutput)
    assert error.message.startswith("still unusable after one repair attempt: ")
    assert "no JSON object" in error.message
    assert "token limit" not in error.message
    assert error.raw_output == ""
    assert error.usage == Usage(prompt_tokens=240, completion_tokens=2)
    assert len(provider.requests) == 2


# --- against the fake model server -----------------------------------------------------------


@pytest.fixture
async def fake() -> AsyncIterator[FakeLLM]:
    server = await start_fake_llm(FakeLLMConfig())
    yield server
    await server.stop()


async def score_on(fake: FakeLLM, text: str) -> Any:
    configured = settings(LLM_BASE_URL=fake.url)
    async with make_http_client(configured, concurrency=1) as http:
        return await OpenAIChatModel(http, configured).score(request(text))


async def test_the_fake_models_cut_answer_fails_after_its_repair_naming_the_setting(
    fake: FakeLLM,
) -> None:
    with pytest.raises(UnusableOutput, match="LLM_MAX_OUTPUT_TOKENS raises it") as caught:
        await score_on(fake, "An essay [[id:cut]] [[fake:length]]")
    assert fake.stats()["by_id"] == {"cut": 2}  # the answer and its repair, both cut
    assert caught.value.usage is not None
    assert caught.value.usage.prompt_tokens > 0
    assert caught.value.usage.completion_tokens == 2 * MAX_OUTPUT_TOKENS  # the max_tokens sent
    assert caught.value.model == "gpt-4o-mini-2024-07-18"


async def test_the_fake_models_answer_without_a_choice_is_retryable_and_billed(
    fake: FakeLLM,
) -> None:
    text = "An essay [[id:none]] [[fake:nochoicesx1]]"
    with pytest.raises(ModelUnavailable) as caught:
        await score_on(fake, text)
    assert caught.value.retryable
    assert caught.value.usage is not None
    assert caught.value.usage.prompt_tokens > 0
    assert caught.value.model == "gpt-4o-mini-2024-07-18"
    assert 0 <= (await score_on(fake, text)).result.score <= 10  # the retry is answered
    assert fake.stats()["by_id"] == {"none": 2}


def _cut_mid_character(content: bytes) -> Answer:
    """A chat completion cut at the token limit inside a character, `content` spliced in as
    raw bytes (a JSON string's inside, quotes escaped)."""
    head = (
        b'{"object": "chat.completion", "model": "' + ANSWERED_MODEL.encode() + b'", '
        b'"choices": [{"index": 0, "message": {"role": "assistant", "content": "'
    )
    tail = (
        b'"}, "finish_reason": "length"}], '
        b'"usage": {"prompt_tokens": 120, "completion_tokens": 300}}'
    )
    return Answer(200, head + content + tail, {"Content-Type": "application/json"})


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b'{\\"score\\": 7, \\"comment\\": \\"Clear \xf0\x9f', id="raw-half-emoji"),
        pytest.param(b'{\\"score\\": 7, \\"comment\\": \\"Clear \\ud83d', id="lone-surrogate"),
    ],
)
async def test_an_answer_cut_inside_a_character_is_repaired_and_billed(content: bytes) -> None:
    """The body was unreadable whole: the task failed for good as "misconfigured", without
    its repair, and the tokens it reported went unmetered."""
    provider = ScriptedProvider(
        _cut_mid_character(content), finished(GOOD, "stop", completion_tokens=20)
    )
    verdict = await score_with(provider)
    assert verdict.result.score == 7.5
    assert verdict.result.usage == Usage(prompt_tokens=240, completion_tokens=320)
    assert len(provider.requests) == 2


async def test_a_reasoning_model_is_scored_in_the_dialect_its_refusals_ask_for(
    fake: FakeLLM, caplog: pytest.LogCaptureFixture
) -> None:
    """The fake refuses, as OpenAI does, `max_tokens` and a temperature of 0 for a model
    such as gpt-5-mini. The settings are one for all models: where a request may name
    another model than `LLM_MODEL`, every task of the other kind failed as misconfigured,
    whichever way they were set. Each refusal of one of the two is answered by sending the
    call again as it asks, and the model's later calls are sent so from the start."""
    asked = ScoringRequest(task_id="t-1", text="A short essay.", rubric=None, model="gpt-5-mini")
    defaults = settings(LLM_BASE_URL=fake.url)
    async with make_http_client(defaults, concurrency=1) as http:
        model = OpenAIChatModel(http, defaults)
        with caplog.at_level(logging.WARNING, logger="scorebox.scorer.model"):
            verdict = await model.score(asked)
        assert 0 <= verdict.result.score <= 10
        assert fake.stats()["status_counts"] == {"400": 2, "200": 1}
        assert "gpt-5-mini refused a parameter" in caplog.records[-1].getMessage()

        fake.reset()
        await model.score(dataclasses.replace(asked, task_id="t-2", text="Another."))
        assert fake.stats()["status_counts"] == {"200": 1}  # learnt: sent so at once
        await model.score(dataclasses.replace(asked, task_id="t-3", model=None))
        assert fake.stats()["status_counts"] == {"200": 2}  # the default model as configured


def _unsupported(param: str) -> Answer:
    return json_answer(
        400,
        {
            "error": {
                "message": f"Unsupported parameter: '{param}' is not supported with this model.",
                "type": "invalid_request_error",
                "param": param,
                "code": "unsupported_parameter",
            }
        },
    )


@pytest.mark.parametrize(
    ("param", "overrides"),
    [
        pytest.param("response_format", {}, id="another-parameter"),
        pytest.param("temperature", {"LLM_TEMPERATURE": ""}, id="a-parameter-not-sent"),
    ],
)
async def test_a_refusal_of_anything_else_is_still_the_settings_failure(
    param: str, overrides: dict[str, str]
) -> None:
    """Only the output limit's field and a temperature sent are a question of dialect: any
    other 400 is the settings' (an unsupported `LLM_JSON_MODE`, say), and is not sent again."""
    provider = ScriptedProvider(_unsupported(param), finished(GOOD, "stop"))
    with pytest.raises(ModelMisconfigured, match=f"'{param}' is not supported"):
        await score_with(provider, None, **overrides)
    assert len(provider.requests) == 1


async def test_a_server_refusing_both_limit_fields_is_sent_each_once() -> None:
    provider = ScriptedProvider(
        _unsupported("max_tokens"), _unsupported("max_completion_tokens"), finished(GOOD, "stop")
    )
    with pytest.raises(ModelMisconfigured, match="max_completion_tokens"):
        await score_with(provider, LLM_TEMPERATURE="")
    assert len(provider.requests) == 2
