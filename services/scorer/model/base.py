"""What every scoring model takes and gives: the `ScoreModel` protocol and its data."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Protocol

from shared.contracts import ScoreResult

FLAG_TRUNCATED: Final = "truncated"
"""The text was longer than LLM_MAX_INPUT_CHARS; only its beginning was scored."""
FLAG_INSTRUCTION_IN_TEXT: Final = "instruction_in_text"
"""The text tries to steer its judge; the score may be less trustworthy."""
FLAG_REPAIRED: Final = "repaired"
"""The model's first answer was unusable; the score comes from its repaired answer."""


@dataclass(frozen=True)
class ScoringRequest:
    """A text to score; `rubric` and `model` fall back to the defaults when `None`."""

    task_id: str
    text: str
    rubric: str | None = None
    model: str | None = None


@dataclass(frozen=True)
class ModelVerdict:
    """A validated result, with the model's raw output kept for audit, and the model asked
    for (`requested_model`: the request's `model` or the configured default; the heuristic's
    own name), which the gateway's result-cache key names, unlike the provider's answer
    (`result.model`, e.g. "gpt-4o-mini-2024-07-18" for "gpt-4o-mini"). None when unknown."""

    result: ScoreResult
    raw_output: str | None
    requested_model: str | None = None


class ScoreModel(Protocol):
    """Scores texts. Raises only `services.scorer.errors.ScoringError` subclasses.

    `name` is the model used when a request names none (e.g. "heuristic-v1", "gpt-4o-mini").
    Implementations never retry: the scorer owns retries, through the broker.
    """

    name: str

    async def score(self, request: ScoringRequest) -> ModelVerdict: ...

    async def check(self, model: str | None = None) -> None:
        """Whether the provider answers now for `model` (None: the default), by a call that
        is no text's: returns when it answers with a success, raises the `score` errors
        otherwise."""
        ...
