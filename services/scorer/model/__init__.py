"""The scorer's model layer: from a text to a validated `ScoreResult`, or a typed error.

`build_model(settings, http)` picks the provider named by LLM_PROVIDER:

- `heuristic` (default): `HeuristicModel`, offline and deterministic;
- `openai`: `OpenAIChatModel`, any OpenAI-compatible chat-completions server; it needs the
  client from `make_http_client`.
"""

from __future__ import annotations

from services.scorer.model.base import (
    FLAG_INSTRUCTION_IN_TEXT,
    FLAG_REPAIRED,
    FLAG_TRUNCATED,
    ModelVerdict,
    ScoreModel,
    ScoringRequest,
)
from services.scorer.model.heuristic import HEURISTIC_MODEL_NAME, HeuristicModel
from services.scorer.model.http_client import (
    ProviderClient,
    ProviderReply,
    make_http_client,
    provider_connector,
)
from services.scorer.model.normalise import fit_to_budget, text_fingerprint
from services.scorer.model.openai import OpenAIChatModel
from services.scorer.model.parsing import Verdict, parse_verdict
from services.scorer.model.prompt import PROMPT_VERSION, detect_instructions
from services.scorer.model.settings import ModelSettings
from shared.text import normalise_text

__all__ = [
    "FLAG_INSTRUCTION_IN_TEXT",
    "FLAG_REPAIRED",
    "FLAG_TRUNCATED",
    "HEURISTIC_MODEL_NAME",
    "PROMPT_VERSION",
    "HeuristicModel",
    "ModelSettings",
    "ModelVerdict",
    "OpenAIChatModel",
    "ProviderClient",
    "ProviderReply",
    "ScoreModel",
    "ScoringRequest",
    "Verdict",
    "build_model",
    "detect_instructions",
    "fit_to_budget",
    "make_http_client",
    "normalise_text",
    "parse_verdict",
    "provider_connector",
    "text_fingerprint",
]


def build_model(settings: ModelSettings, http: ProviderClient | None) -> ScoreModel:
    """The model LLM_PROVIDER names; `http` is required by (and only used by) `openai`."""
    if settings.llm_provider == "heuristic":
        return HeuristicModel(max_input_chars=settings.llm_max_input_chars)
    if http is None:
        raise ValueError("LLM_PROVIDER=openai needs an HTTP client (see make_http_client)")
    return OpenAIChatModel(http, settings)
