"""The compose stack's scorer gets every `LLM_*` setting the scorer reads.

LLM_JSON_MODE and LLM_MAX_* never reached the container: set in the shell or .env, they were
silently ignored (a server without structured outputs kept failing every task).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from services.scorer.model.settings import ModelSettings

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "compose.yaml"


def _scorer_environment() -> dict[str, Any]:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read compose.yaml")
    compose = yaml.safe_load(COMPOSE_FILE.read_text())
    environment: dict[str, Any] = compose["services"]["scorer"]["environment"]
    return environment


def _llm_variables() -> list[str]:
    names = [field.validation_alias for field in ModelSettings.model_fields.values()]
    return sorted(name for name in names if isinstance(name, str) and name.startswith("LLM_"))


def test_the_scorer_model_settings_are_all_llm_variables() -> None:
    """The list below is read from the settings class, so a new setting is checked too."""
    assert {
        "LLM_PROVIDER",
        "LLM_JSON_MODE",
        "LLM_MAX_INPUT_CHARS",
        "LLM_MAX_OUTPUT_TOKENS",
    } <= set(_llm_variables())


@pytest.mark.parametrize("name", _llm_variables())
def test_compose_passes_the_llm_setting_to_the_scorer(name: str) -> None:
    environment = _scorer_environment()

    assert name in environment, f"compose.yaml: the scorer never gets {name}"
    value = environment[name]
    # Passed through from the shell or .env: bare (unset stays unset) or ${NAME...}.
    assert value is None or str(value).startswith(f"${{{name}"), value
