"""The scorer's stop gives a delivery that just took a model slot the whole of its path.

The grace period was `LLM_TIMEOUT_S` + 2 x `BROKER_TIMEOUT_S`: the claim and the
`spent_before` read before the call, the `task.started` confirm that may follow it and the
decision's write were not counted, and the lifespan closed the model client and the database
under a decision still running. Read from the settings, without a broker or a clock.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import services.scorer.app as scorer_app
from devtools.stack import run_stop_grace_s
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from shared.runtime import HTTP_DRAIN_S
from tests.support import graceful_timeout_given

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "compose.yaml"
TIMEOUTS = {"LLM_TIMEOUT_S": "40", "MONGO_TIMEOUT_S": "7", "BROKER_TIMEOUT_S": "3"}


def _slot_path_s(settings: ScorerSettings, model_settings: ModelSettings) -> float:
    """Each bounded step of a delivery in a model slot, from its claim to its last confirm."""
    mongo_s, broker_s = settings.mongo_timeout_s, settings.broker_timeout_s
    steps = {
        "claim": mongo_s,
        "spent_before": mongo_s,
        "model call": model_settings.llm_timeout_s,
        "task.started confirmed": broker_s,
        "decision recorded": mongo_s,
        "outcome and dead letter, or next attempt and task.retrying, confirmed": 2 * broker_s,
        "the batch of completions in flight ahead of the outcome confirmed": broker_s,
    }
    return sum(steps.values())


def _graceful_timeout_of_create_app(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> float:
    """The graceful timeout `create_app` gives the broker it makes (nothing is started)."""
    return graceful_timeout_given(
        monkeypatch,
        scorer_app,
        lambda: scorer_app.create_app(
            ScorerSettings.model_validate(env), ModelSettings.model_validate(env)
        ),
    )


@pytest.mark.parametrize("env", [{}, TIMEOUTS], ids=["defaults", "other timeouts"])
def test_the_stop_grace_covers_a_slot_s_whole_path(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    expected = _slot_path_s(ScorerSettings.model_validate(env), ModelSettings.model_validate(env))

    assert _graceful_timeout_of_create_app(monkeypatch, env) >= expected


def test_compose_waits_for_the_grace_and_the_stop_s_own_steps() -> None:
    """The orchestrator's SIGKILL must not cut the grace short: compose's period covers it
    and the consumers' cancel, the acks and the closes (one broker timeout each) around it."""
    settings, model_settings = ScorerSettings(), ModelSettings()
    scorer = COMPOSE_FILE.read_text().split("\n  scorer:\n", 1)[1].split("\n  scheduler:\n")[0]
    found = re.search(r"^\s+stop_grace_period: (\d+)s$", scorer, re.MULTILINE)
    assert found is not None, "the scorer has no stop_grace_period in seconds"
    stop_steps_s = 3 * settings.broker_timeout_s

    assert int(found[1]) >= _slot_path_s(settings, model_settings) + stop_steps_s


@pytest.mark.parametrize("env", [{}, TIMEOUTS], ids=["defaults", "other timeouts"])
def test_make_run_waits_for_the_scorers_whole_stop(env: dict[str, str]) -> None:
    """`make run` SIGKILLed its services 60 s after Ctrl-C, while the scorer's stop may take
    105 s by default: killed mid-decision, the redelivery made (and billed) the model call
    again. uvicorn's wait for open requests comes first, then the grace, then the stop's
    own steps (one broker timeout each), all under the timeouts the scorer runs with."""
    settings, model_settings = ScorerSettings.model_validate(env), ModelSettings.model_validate(env)
    stop_steps_s = 3 * settings.broker_timeout_s
    needed = HTTP_DRAIN_S + _slot_path_s(settings, model_settings) + stop_steps_s

    assert run_stop_grace_s(env) >= needed
