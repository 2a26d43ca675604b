"""A model error carries the tokens of the answers that came back before it, retryable or not.

The provider bills an unusable answer; whatever becomes of its repair (refused, throttled,
a 5xx, cut short by LLM_TIMEOUT_S), the error reports that answer's usage and model, for the
scorer to meter with the task's outcome. A real HTTP server answers a script of replies.
"""

from __future__ import annotations

import pytest

from services.scorer.errors import ModelRateLimited, ModelTimeout, ModelUnavailable, ScoringError
from shared.contracts import Usage
from tests.unit.test_model_openai import (
    Misbehaviour,
    Reply,
    ScriptedProvider,
    completion,
    json_answer,
    provider_error,
    score_with,
)

UNUSABLE = completion("Seven out of ten, I think.", prompt_tokens=100, completion_tokens=10)
FIRST_ANSWER = Usage(prompt_tokens=100, completion_tokens=10)
ANSWERED_MODEL = "gpt-4o-mini-2024-07-18"


@pytest.mark.parametrize(
    ("repair", "error"),
    [
        pytest.param(provider_error(503, "overloaded"), ModelUnavailable, id="503"),
        pytest.param(
            provider_error(429, "slow down", "rate_limit_exceeded", **{"Retry-After": "3"}),
            ModelRateLimited,
            id="429",
        ),
        pytest.param(Misbehaviour.RESET, ModelUnavailable, id="reset"),
    ],
)
async def test_a_repair_failing_for_now_carries_the_first_answers_tokens(
    repair: Reply, error: type[ScoringError]
) -> None:
    provider = ScriptedProvider(UNUSABLE, repair)
    with pytest.raises(error) as caught:
        await score_with(provider)
    assert caught.value.retryable
    assert caught.value.usage == FIRST_ANSWER
    assert caught.value.model == ANSWERED_MODEL
    assert len(provider.requests) == 2


async def test_a_repair_cut_short_by_the_deadline_carries_the_first_answers_tokens() -> None:
    provider = ScriptedProvider(UNUSABLE, Misbehaviour.HANG)
    with pytest.raises(ModelTimeout) as caught:
        await score_with(provider, LLM_TIMEOUT_S=0.5)
    assert caught.value.usage == FIRST_ANSWER
    assert caught.value.model == ANSWERED_MODEL


async def test_a_first_call_that_never_answered_carries_no_tokens() -> None:
    with pytest.raises(ModelTimeout) as caught:
        await score_with(ScriptedProvider(Misbehaviour.HANG), LLM_TIMEOUT_S=0.5)
    assert caught.value.usage is None
    with pytest.raises(ModelUnavailable) as failed:
        await score_with(ScriptedProvider(provider_error(503, "overloaded")))
    assert failed.value.usage is None


async def test_an_error_in_a_200_carries_the_usage_it_reports() -> None:
    """A gateway answering 200 with an upstream failure in its body (OpenRouter) and the
    usage the call was billed: retried, and those tokens metered."""
    billed = json_answer(
        200,
        {
            "error": {"code": 502, "message": "upstream failed mid-answer"},
            "usage": {"prompt_tokens": 70, "completion_tokens": 5},
        },
    )
    with pytest.raises(ModelUnavailable) as caught:
        await score_with(ScriptedProvider(billed))
    assert caught.value.usage == Usage(prompt_tokens=70, completion_tokens=5)
    assert caught.value.model == "gpt-4o-mini"

    unbilled = json_answer(200, {"error": {"code": 429, "message": "slow down"}})
    with pytest.raises(ModelRateLimited) as limited:
        await score_with(ScriptedProvider(unbilled))
    assert limited.value.usage is None


async def test_an_unusable_answer_then_an_unusable_error_200_adds_both() -> None:
    billed = json_answer(
        200, {"error": {"code": 503, "message": "busy"}, "usage": {"prompt_tokens": 150}}
    )
    with pytest.raises(ModelUnavailable) as caught:
        await score_with(ScriptedProvider(UNUSABLE, billed))
    assert caught.value.usage == Usage(prompt_tokens=250, completion_tokens=10)
