"""Text clean-up before scoring: a length budget and a cache fingerprint. The canonical form
itself (`normalise_text`) is `shared.text`'s, which the gateway applies too."""

from __future__ import annotations

import hashlib
import json
import re

from services.scorer.model.prompt import PROMPT_VERSION
from shared.text import normalise_text

# Cut points tried when a text is over budget, best first: a paragraph, a sentence, a word.
_PARAGRAPH_END = re.compile(r"\n\n")
_SENTENCE_END = re.compile(r"[.!?\u2026][\"')\]\u00bb\u201d\u2019]*(?=\s)|[\u3002\uff01\uff1f]")
_WORD_END = re.compile(r"\S(?=\s)")
# A cut point counts as "near the limit" when it keeps at least this share of the budget.
_MIN_KEPT_SHARE = 0.8


def fit_to_budget(text: str, max_chars: int) -> tuple[str, bool]:
    """`text` cut to at most `max_chars` characters, and whether it was cut.

    The cut falls at the end of a paragraph, else of a sentence, else of a word, as long as
    that keeps most of the budget; otherwise the text is cut at exactly `max_chars`.
    """
    if max_chars <= 0:
        raise ValueError(f"max_chars must be positive, got {max_chars}")
    if len(text) <= max_chars:
        return text, False
    window = text[: max_chars + 1]  # one more: a boundary right at the limit still counts
    floor = int(max_chars * _MIN_KEPT_SHARE)
    for boundary in (_PARAGRAPH_END, _SENTENCE_END, _WORD_END):
        cut = _last_boundary(boundary, window, floor, max_chars)
        if cut is not None:
            return text[:cut].rstrip(), True
    return text[:max_chars].rstrip(), True


def _last_boundary(pattern: re.Pattern[str], window: str, floor: int, limit: int) -> int | None:
    ends = [m.end() for m in pattern.finditer(window, floor) if m.end() <= limit]
    return ends[-1] if ends else None


def text_fingerprint(text: str, rubric: str | None, model: str) -> str:
    """Key of the result cache: sha256 (hex) of the normalised text, rubric and model.

    The prompt version is part of the key, so a new prompt never serves stale scores.
    No rubric and a blank rubric both mean the default rubric, so they share a key.
    """
    canonical_rubric = normalise_text(rubric) if rubric else ""
    payload = json.dumps(
        [PROMPT_VERSION, normalise_text(text), canonical_rubric, model], ensure_ascii=False
    )
    return hashlib.sha256(payload.encode()).hexdigest()
