"""What a check of the provider found (`services/scorer/provider_checks.py`): the answer the
model's `check` gives, or the error it raises, as the throttle reads it."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry

from services.scorer.errors import (
    InputRejected,
    ModelMisconfigured,
    ModelRateLimited,
    ModelReplyUnusable,
    ModelTimeout,
    ModelUnavailable,
    ScoringError,
)
from services.scorer.metrics import ScorerMetrics
from services.scorer.model import ModelVerdict, ScoringRequest
from services.scorer.provider_checks import provider_checks
from services.scorer.throttle import ProviderCheck, ProviderFound
from tests.support import sample


class CheckedModel:
    """A model whose check raises `raises` (or returns, when None), noting the model named."""

    name = "checked-1"

    def __init__(self, raises: Exception | None) -> None:
        self._raises = raises
        self.checked: str | None = None

    async def score(self, request: ScoringRequest) -> ModelVerdict:
        raise NotImplementedError

    async def check(self, model: str | None = None) -> None:
        self.checked = model
        if self._raises is not None:
            raise self._raises


@pytest.mark.parametrize(
    ("raises", "found"),
    [
        (None, ProviderCheck(ProviderFound.ANSWERED)),
        (ModelMisconfigured("404 from the provider"), ProviderCheck(ProviderFound.ANSWERED)),
        (InputRejected("400 from the provider"), ProviderCheck(ProviderFound.ANSWERED)),
        (ModelReplyUnusable("no choices"), ProviderCheck(ProviderFound.ANSWERED)),
        (
            ModelRateLimited("429", retry_after_s=7),
            ProviderCheck(ProviderFound.RATE_LIMITED, retry_after_s=7),
        ),
        (
            ModelUnavailable("503", retry_after_s=3),
            ProviderCheck(ProviderFound.UNAVAILABLE, retry_after_s=3),
        ),
        (ModelTimeout("no answer"), ProviderCheck(ProviderFound.UNAVAILABLE)),
    ],
)
async def test_a_check_is_found_answered_unless_the_provider_is_down_or_limiting(
    raises: ScoringError | None, found: ProviderCheck
) -> None:
    registry = CollectorRegistry()
    check = provider_checks(CheckedModel(raises), ScorerMetrics(registry))

    assert await check(None) == found
    checks = "scorebox_model_provider_checks_total"
    assert sample(registry, checks, found=found.found.value) == 1


async def test_the_check_is_of_the_model_named() -> None:
    model = CheckedModel(None)
    await provider_checks(model, ScorerMetrics())("other-model")
    assert model.checked == "other-model"


async def test_a_check_failing_for_a_defect_of_its_own_is_taken_as_answered(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Not news of the provider: the texts' own calls tell. Taken for the provider down, a
    defect would hold every call for as long as it lasted."""
    check = provider_checks(CheckedModel(RuntimeError("a bug")), ScorerMetrics())
    assert await check(None) == ProviderCheck(ProviderFound.ANSWERED)
    assert "a check of the provider failed" in caplog.text
