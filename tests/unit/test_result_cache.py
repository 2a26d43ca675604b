"""The result cache key and what may be cached."""

from __future__ import annotations

import hashlib
import re
import unicodedata

import orjson
from hypothesis import given, settings
from hypothesis import strategies as st

from services.gateway.cache import cache_key, cacheable, scoring_model
from services.gateway.settings import GatewaySettings
from shared.contracts import ScoreResult


def test_texts_differing_only_in_whitespace_and_unicode_form_share_a_key() -> None:
    assert cache_key("  Café  au\tlait\n", None, None) == cache_key(
        "Cafe\u0301 au lait", None, None
    )
    assert cache_key("text", "rubric", None) != cache_key("text", None, None)
    assert cache_key("text", None, "model-a") != cache_key("text", None, "model-b")
    assert cache_key("Text", None, None) != cache_key("text", None, None)


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


def test_a_key_stays_what_earlier_releases_stored() -> None:
    """Keys are stored with each submission and in the cache: one computed another way
    would miss every result cached before a deploy. Pinned for texts with every kind of
    blank, as the regex substitution of earlier releases computed it."""
    text = "\u00a0 Caf\u00e9\t\tau\u2003lait\r\n\n  x\u3000"
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
def test_the_key_folds_blanks_as_a_whitespace_regex_does(text: str) -> None:
    folded = re.sub(r"\s+", " ", unicodedata.normalize("NFC", text)).strip()
    expected = hashlib.sha256(orjson.dumps([folded, "", ""])).hexdigest()
    assert cache_key(text, None, None) == expected
