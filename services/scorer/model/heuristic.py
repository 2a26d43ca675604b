"""An offline, deterministic scorer of surface features: the default provider.

It needs no network and no key, so the system runs anywhere; it judges form, not content.
Six features, each rated 0..1, are weighted into a 0..10 score:

    length        enough words to develop a point (150+)
    sentences     average sentence length in a readable band, with some variety
    vocabulary    lexical diversity (moving-average type-token ratio, window 50)
    paragraphs    paragraph breaks in longer texts, neither walls nor fragments
    punctuation   sentences end properly, commas are used, no "!!!" or shouting
    repetition    few repeated word trigrams
"""

from __future__ import annotations

import json
import math
import re
import statistics
import time
from collections import Counter
from dataclasses import dataclass
from typing import Final

from services.scorer.model.base import ModelVerdict, ScoringRequest
from services.scorer.model.preparation import prepare_text
from shared.contracts import HEURISTIC_PROMPT_VERSION, ScoreResult, Usage

HEURISTIC_MODEL_NAME: Final = HEURISTIC_PROMPT_VERSION

_WEIGHTS: Final = {
    "length": 0.20,
    "sentences": 0.15,
    "vocabulary": 0.20,
    "paragraphs": 0.15,
    "punctuation": 0.15,
    "repetition": 0.15,
}
_STRENGTHS: Final = {
    "length": "adequate length",
    "sentences": "well-paced, varied sentences",
    "vocabulary": "varied vocabulary",
    "paragraphs": "clear paragraphing",
    "punctuation": "sound punctuation",
    "repetition": "little repetition",
}
_WEAKNESSES: Final = {
    "length": "too short to develop a point",
    "sentences": "sentence lengths that are extreme or monotonous",
    "vocabulary": "repetitive vocabulary",
    "paragraphs": "missing or fragmented paragraphs",
    "punctuation": "sparse or excessive punctuation",
    "repetition": "repeated phrases",
}
_STRONG: Final = 0.85
_WEAK: Final = 0.6

_WORD: Final = re.compile(r"\w+(?:['\u2019]\w+)*")
_SENTENCE_BREAK: Final = re.compile(r"(?<=[.!?\u2026\u3002\uff01\uff1f])\s+|\n+")
_TERMINAL: Final = re.compile(r"[.!?\u2026\u3002\uff01\uff1f]")
_PARAGRAPH_BREAK: Final = re.compile(r"\n\s*\n")
_EXCESS_MARKS: Final = re.compile(r"[!?]{2,}")
_TTR_WINDOW: Final = 50
_SUBSTANTIAL_WORDS: Final = 100
_CHARS_PER_TOKEN: Final = 4


@dataclass(frozen=True)
class TextFeatures:
    """Raw measurements of a text."""

    words: list[str]
    sentence_lengths: list[int]
    paragraph_lengths: list[int]
    terminal_marks: int
    commas: int
    excess_marks: int
    shouted_words: int


def measure(text: str) -> TextFeatures:
    """The measurements the heuristic rates."""
    words = _WORD.findall(text)
    sentences = [s for s in _SENTENCE_BREAK.split(text) if _WORD.search(s)]
    paragraphs = [p for p in _PARAGRAPH_BREAK.split(text) if _WORD.search(p)]
    return TextFeatures(
        words=[word.lower() for word in words],
        sentence_lengths=[len(_WORD.findall(s)) for s in sentences],
        paragraph_lengths=[len(_WORD.findall(p)) for p in paragraphs],
        terminal_marks=len(_TERMINAL.findall(text)),
        commas=text.count(",") + text.count("\uff0c"),
        excess_marks=len(_EXCESS_MARKS.findall(text)),
        shouted_words=sum(1 for w in words if len(w) >= 3 and w.isupper()),
    )


def rate(features: TextFeatures) -> dict[str, float]:
    """Each feature rated from 0 (poor) to 1 (good)."""
    return {
        "length": _rate_length(len(features.words)),
        "sentences": _rate_sentences(features.sentence_lengths),
        "vocabulary": _rate_vocabulary(features.words),
        "paragraphs": _rate_paragraphs(features.paragraph_lengths),
        "punctuation": _rate_punctuation(features),
        "repetition": _rate_repetition(features.words),
    }


def _ramp(value: float, low: float, high: float) -> float:
    """0 at or below `low`, 1 at or above `high`, linear between."""
    return min(1.0, max(0.0, (value - low) / (high - low)))


def _rate_length(word_count: int) -> float:
    return _ramp(word_count, 0, 150)


def _rate_sentences(lengths: list[int]) -> float:
    if not lengths:
        return 0.0
    mean = statistics.fmean(lengths)
    pace = min(_ramp(mean, 3, 10), 1 - _ramp(mean, 25, 50))
    if len(lengths) < 2:
        return 0.5 * pace
    variation = statistics.pstdev(lengths) / mean
    variety = min(_ramp(variation, 0, 0.35), 1 - 0.4 * _ramp(variation, 1, 2))
    return 0.5 * pace + 0.5 * variety


def _rate_vocabulary(words: list[str]) -> float:
    if not words:
        return 0.0
    return _ramp(_moving_type_token_ratio(words), 0.4, 0.72)


def _moving_type_token_ratio(words: list[str]) -> float:
    if len(words) <= _TTR_WINDOW:
        return len(set(words)) / len(words)
    window = Counter(words[:_TTR_WINDOW])
    ratios = [len(window) / _TTR_WINDOW]
    for leaving, entering in zip(words, words[_TTR_WINDOW:], strict=False):
        window[leaving] -= 1
        if window[leaving] == 0:
            del window[leaving]
        window[entering] += 1
        ratios.append(len(window) / _TTR_WINDOW)
    return statistics.fmean(ratios)


def _rate_paragraphs(lengths: list[int]) -> float:
    words = sum(lengths)
    if words < 80:  # too short to need paragraphs
        return 1.0
    mean = words / len(lengths)
    if mean > 180:
        return 180 / mean
    return max(0.3, min(1.0, mean / 30))


def _rate_punctuation(features: TextFeatures) -> float:
    words = len(features.words)
    if not words:
        return 0.0
    endings = min(1.0, features.terminal_marks / max(1.0, words / 25))
    commas = 1.0 if words < 60 else min(1.0, features.commas / (words / 40))
    shouting = features.shouted_words / words + features.excess_marks / max(1, words / 50)
    restraint = 1 - min(1.0, 2 * shouting)
    return 0.5 * endings + 0.25 * commas + 0.25 * restraint


def _rate_repetition(words: list[str]) -> float:
    trigrams = list(zip(words, words[1:], words[2:], strict=False))
    if len(trigrams) < 2:
        return 1.0
    repeated_share = 1 - len(set(trigrams)) / len(trigrams)
    return 1 - _ramp(repeated_share, 0.02, 0.3)


def overall_score(ratings: dict[str, float], word_count: int) -> float:
    """The weighted ratings on the 0..10 scale, to one decimal.

    Diversity, repetition and paragraphing are trivially perfect in a few words, so the
    total is scaled down for texts under `_SUBSTANTIAL_WORDS` words.
    """
    weighted = sum(_WEIGHTS[name] * rating for name, rating in ratings.items())
    substance = 0.4 + 0.6 * _ramp(word_count, 0, _SUBSTANTIAL_WORDS)
    return round(10 * weighted * substance, 1)


def explain(score: float, ratings: dict[str, float]) -> str:
    """A short comment naming the strongest and weakest features."""
    ordered = sorted(ratings, key=lambda name: (-ratings[name], name))
    strengths = [_STRENGTHS[name] for name in ordered if ratings[name] >= _STRONG]
    weaknesses = [_WEAKNESSES[name] for name in reversed(ordered) if ratings[name] < _WEAK]
    parts = [f"Heuristic score {score:.1f}/10 from surface features of the writing."]
    if strengths:
        parts.append(f"Strengths: {'; '.join(strengths)}.")
    if weaknesses:
        parts.append(f"Weaknesses: {'; '.join(weaknesses)}.")
    return " ".join(parts)


def estimate_tokens(text: str) -> int:
    """A rough token count (four characters a token), for usage accounting."""
    return math.ceil(len(text) / _CHARS_PER_TOKEN)


class HeuristicModel:
    """The default `ScoreModel`: rates surface features offline, deterministically.

    The same text always gets the same score and comment. A request's `model` is ignored.
    """

    def __init__(self, *, max_input_chars: int = 6000) -> None:
        self.name: str = HEURISTIC_MODEL_NAME
        self._max_input_chars = max_input_chars

    async def score(self, request: ScoringRequest) -> ModelVerdict:
        started = time.perf_counter()
        prepared = prepare_text(request.text, max_chars=self._max_input_chars)
        features = measure(prepared.text)
        ratings = rate(features)
        score = overall_score(ratings, len(features.words))
        comment = explain(score, ratings)
        result = ScoreResult(
            score=score,
            comment=comment,
            model=self.name,
            usage=Usage(
                prompt_tokens=estimate_tokens(prepared.text),
                completion_tokens=estimate_tokens(comment),
            ),
            latency_ms=(time.perf_counter() - started) * 1000,
            flags=list(prepared.flags),
            prompt_version=self.name,
        )
        raw_output = json.dumps({name: round(value, 3) for name, value in ratings.items()})
        # Whatever the request named: the gateway keys the heuristic's results by its name.
        return ModelVerdict(result=result, raw_output=raw_output, requested_model=self.name)

    async def check(self, model: str | None = None) -> None:
        """Offline: always there."""
