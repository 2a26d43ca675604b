"""The result cache key and what may be cached."""

from __future__ import annotations

from services.gateway.cache import cache_key, cacheable
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
