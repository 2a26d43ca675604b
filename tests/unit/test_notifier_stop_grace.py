"""The notifier's stop gives a delivery in hand the whole of its path.

The grace period was `WEBHOOK_DNS_TIMEOUT_S` + `WEBHOOK_TIMEOUT_S` + 2 x `BROKER_TIMEOUT_S`:
the claim holder's database calls were not counted, so with a slow database during a deploy
a POST answered was cut off from its record, and its redelivery POSTed it again once the
lease ran out (the notifier's re-read). Read from the settings, without a broker.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

import services.notifier.app as notifier_app
from devtools.stack import run_stop_grace_s
from services.notifier.settings import NotifierSettings
from shared.runtime import HTTP_DRAIN_S
from tests.support import graceful_timeout_given

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "compose.yaml"
TIMEOUTS = {
    "WEBHOOK_DNS_TIMEOUT_S": "4",
    "WEBHOOK_TIMEOUT_S": "20",
    "MONGO_TIMEOUT_S": "7",
    "BROKER_TIMEOUT_S": "3",
}


def _delivery_path_s(settings: NotifierSettings) -> float:
    """Each bounded step of a delivery in hand, from its claim to its last confirm."""
    mongo_s, broker_s = settings.mongo_timeout_s, settings.broker_timeout_s
    steps = {
        "the consumers' cancel, within the grace (`ScoreboxBroker.stop`)": broker_s,
        "claim": mongo_s,
        "keyring read": mongo_s,
        "DNS check": settings.dns_timeout_s,
        "POST": settings.timeout_s,
        "outcome recorded": mongo_s,
        "what it decided, published and confirmed": 2 * broker_s,
    }
    return sum(steps.values())


def _graceful_timeout_of_create_app(monkeypatch: pytest.MonkeyPatch, env: dict[str, str]) -> float:
    """The graceful timeout `create_app` gives the broker it makes (nothing is started)."""
    return graceful_timeout_given(
        monkeypatch,
        notifier_app,
        lambda: notifier_app.create_app(NotifierSettings.model_validate(env)),
    )


@pytest.mark.parametrize("env", [{}, TIMEOUTS], ids=["defaults", "other timeouts"])
def test_the_stop_grace_covers_a_deliverys_whole_path(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str]
) -> None:
    expected = _delivery_path_s(NotifierSettings.model_validate(env))

    assert _graceful_timeout_of_create_app(monkeypatch, env) >= expected


def _whole_stop_s(settings: NotifierSettings) -> float:
    """The HTTP drain, a delivery's whole path, then the acks and the closes (one broker
    timeout each)."""
    return HTTP_DRAIN_S + _delivery_path_s(settings) + 2 * settings.broker_timeout_s


def test_compose_waits_for_the_drain_the_grace_and_the_stops_own_steps() -> None:
    """The orchestrator's SIGKILL must not cut the grace short."""
    notifier = COMPOSE_FILE.read_text().split("\n  notifier:\n", 1)[1]
    found = re.search(r"^\s+stop_grace_period: (\d+)s$", notifier, re.MULTILINE)
    assert found is not None, "the notifier has no stop_grace_period in seconds"

    assert int(found[1]) >= _whole_stop_s(NotifierSettings())


@pytest.mark.parametrize(
    "env", [{}, TIMEOUTS, {"WEBHOOK_TIMEOUT_S": "120"}], ids=["defaults", "other", "long POST"]
)
def test_make_run_waits_for_the_notifiers_whole_stop(env: dict[str, str]) -> None:
    """`make run` waited for the scorer's stop alone: with a long `WEBHOOK_TIMEOUT_S` the
    notifier's is longer, and a POST killed mid-way is POSTed again by its redelivery."""
    assert run_stop_grace_s(env) >= _whole_stop_s(NotifierSettings.model_validate(env))
