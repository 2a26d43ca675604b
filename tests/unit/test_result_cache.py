"""The result cache key and what may be cached."""

from __future__ import annotations

import hashlib
import logging

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.cache import (
    OtherModelCompletions,
    cache_key,
    cacheable,
    scored_by_key_model,
    scoring_model,
)
from services.gateway.settings import GatewaySettings
from shared.contracts import ScoreResult
from shared.text import normalise_text


def test_texts_the_model_would_read_alike_share_a_key() -> None:
    assert cache_key("  Café  au\u00a0lait\n", None, None) == cache_key(
        "Cafe\u0301 au lait", None, None
    )
    assert cache_key("a\r\nb\n\n\n\nc", None, None) == cache_key("a\nb\n\nc", None, None)
    assert cache_key("text", "rubric", None) != cache_key("text", None, None)
    assert cache_key("text", None, "model-a") != cache_key("text", None, "model-b")
    assert cache_key("Text", None, None) != cache_key("text", None, None)


def test_texts_differing_in_their_line_or_paragraph_breaks_do_not_share_a_key() -> None:
    """Breaks were folded into spaces: the model reads them, and a long text is cut at a
    paragraph's end, so one text was served the score of another it would read otherwise."""
    verse = cache_key("Roses are red.\n\nViolets are blue.", None, None)
    assert verse != cache_key("Roses are red. Violets are blue.", None, None)
    assert verse != cache_key("Roses are red.\nViolets are blue.", None, None)
    assert cache_key("a\tb", None, None) != cache_key("a b", None, None)


def test_flagged_or_already_cached_results_are_not_cached() -> None:
    plain = ScoreResult(score=5, comment="c", model="m")
    assert cacheable(plain)
    assert not cacheable(plain.model_copy(update={"flags": ["instruction_in_text"]}))
    assert not cacheable(plain.model_copy(update={"cached": True}))
    assert cacheable(plain.model_copy(update={"flags": ["truncated"]}))


def test_the_heuristic_keys_its_results_by_its_own_name_whatever_model_was_asked() -> None:
    """The offline heuristic scored a submission naming `gpt-4o-mini` under that name's key:
    after a switch to OpenAI, the heuristic's score was served as gpt-4o-mini's for a day."""
    offline = GatewaySettings.model_validate({"LLM_PROVIDER": "heuristic"}).default_model
    online = GatewaySettings.model_validate(
        {"LLM_PROVIDER": "openai", "LLM_MODEL": "gpt-4o-mini"}
    ).default_model
    assert scoring_model("gpt-4o-mini", offline) == scoring_model(None, offline) == offline
    assert scoring_model("gpt-4o-mini", online) == scoring_model(None, online) == "gpt-4o-mini"
    assert scoring_model("gpt-4o", online) == "gpt-4o"


def test_a_text_on_one_line_keeps_the_key_earlier_releases_stored() -> None:
    """Keys are stored with each submission and in the cache: one computed another way
    misses every result cached before a deploy. Texts with no line break or tab, most of
    them, keep the key of the releases that folded every blank into a space."""
    text = "\u00a0 Caf\u00e9  au\u2003lait  x\u3000"
    assert cache_key(text, "r", "m") == (
        hashlib.sha256(orjson.dumps(["Caf\u00e9 au lait x", "r", "m"])).hexdigest()
    )


_PIECES = (
    "a",
    "e\u0301",
    " ",
    "  ",
    "\t",
    "\n",
    "\r\n",
    "\u00a0",
    "\u2028",
    "\x1c",
    "\u3000",
    "\u200b",
)


@settings(max_examples=500, deadline=None)
@given(st.lists(st.sampled_from(_PIECES)).map("".join))
def test_the_key_is_that_of_the_text_the_scorer_sends(text: str) -> None:
    expected = hashlib.sha256(orjson.dumps([normalise_text(text), "", ""])).hexdigest()
    assert cache_key(text, None, None) == expected


def _answered_by(model: str) -> ScoreResult:
    return ScoreResult(score=5.0, comment="ok", model=model)


@pytest.mark.parametrize(
    ("requested", "answered", "key", "cached"),
    [
        ("gpt-4o-mini", "gpt-4o-mini-2024-07-18", "gpt-4o-mini", True),
        ("gpt-4o", "gpt-4o-2024-08-06", "gpt-4o-mini", False),  # what was asked decides
        (None, "gpt-4o-mini-2024-07-18", "gpt-4o-mini", True),  # an earlier build's scorer
        (None, "claude-3-5-haiku-20241022", "claude-3-5-haiku", True),
        (None, "gpt-4o-mini", "gpt-4o-mini", True),
        (None, "heuristic-v1", "gpt-4o-mini", False),  # another provider's answer
        (None, "gpt-4o-mini-2024-07-18", "gpt-4o", False),  # another model, not a date
        (None, "gpt-4o-mini", "gpt-4o-mini-2024-07-18", False),
        ("judge-2", "judge-2", None, True),  # an earlier build's submission
    ],
)
def test_a_completion_fills_only_the_key_of_the_model_that_scored_it(
    requested: str | None, answered: str, key: str | None, cached: bool
) -> None:
    result = _answered_by(answered)
    assert scored_by_key_model(requested_model=requested, result=result, key_model=key) is cached


def test_completions_not_cached_for_another_model_are_warned_of_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [0.0]
    other_model = OtherModelCompletions(every_s=60.0, clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="scorebox.gateway.cache"):
        for task in ("t1", "t2", "t3"):
            other_model.note(task, scored_by="judge-2", keyed_by="judge-1")
        now[0] = 61.0
        other_model.note("t4", scored_by="judge-2", keyed_by="judge-1")

    first, second = (each.getMessage() for each in caplog.records)
    assert "not cached: 1 since the last line, the latest task t1," in first
    assert "not cached: 3 since the last line, the latest task t4," in second
