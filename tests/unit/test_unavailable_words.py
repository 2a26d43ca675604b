"""A 503 names what is away in words, not by a class of the code: the walkthrough found
details such as "StatusUnavailable: a dependency is unavailable"."""

from __future__ import annotations

import pytest

from services.gateway.api import _unavailable, read_unavailable
from services.gateway.cancels_api import _unconfirmed
from services.gateway.errors import (
    BrokerUnavailable,
    DatabaseUnavailable,
    StatusUnavailable,
    Unavailable,
)
from services.gateway.scheduler_client import SchedulerUnavailable
from services.gateway.webhooks_api import NotifierUnavailable


@pytest.mark.parametrize(
    ("error", "words"),
    [
        (BrokerUnavailable("x"), "The message broker is unavailable"),
        (DatabaseUnavailable("x"), "The database is unavailable"),
        (StatusUnavailable("x"), "The status service is unavailable"),
        (SchedulerUnavailable("x"), "The scheduler is unavailable"),
        (NotifierUnavailable("x", maybe_applied=False), "The notifier is unavailable"),
    ],
)
def test_a_503_names_the_dependency_away_in_words(error: Unavailable, words: str) -> None:
    for problem in (_unavailable(error), read_unavailable(error)):
        assert problem.detail.startswith(words), problem.detail
        assert "Unavailable" not in problem.detail


def test_an_unconfirmed_cancel_names_the_broker_in_words() -> None:
    problem = _unconfirmed(BrokerUnavailable("not confirmed"))
    assert problem.detail.startswith("The message broker is unavailable. ")
