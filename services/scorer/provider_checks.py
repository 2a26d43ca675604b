"""Checks of the provider that are no text's call: the throttle's probe of an outage when
no delivery whose call would be news of the provider waits (`ModelThrottle._checks_first`)."""

from __future__ import annotations

from services.scorer.errors import ModelRateLimited, ScoringError, TransientError
from services.scorer.metrics import ScorerMetrics
from services.scorer.model import ScoreModel
from services.scorer.throttle import CheckProvider, ProviderCheck, ProviderFound


def provider_checks(model: ScoreModel, metrics: ScorerMetrics) -> CheckProvider:
    """What `model.check()` found, counted by what it was."""

    async def check_provider() -> ProviderCheck:
        check = await _checked(model)
        metrics.provider_checks.labels(check.found.value).inc()
        return check

    return check_provider


async def _checked(model: ScoreModel) -> ProviderCheck:
    try:
        await model.check()
    except ModelRateLimited as error:
        return ProviderCheck(ProviderFound.RATE_LIMITED, error.retry_after_s)
    except TransientError as error:
        if error.provider_down:
            return ProviderCheck(ProviderFound.UNAVAILABLE, error.retry_after_s)
        return ProviderCheck(ProviderFound.ANSWERED)
    except ScoringError:
        return ProviderCheck(ProviderFound.ANSWERED)  # refused: the provider is up
    return ProviderCheck(ProviderFound.ANSWERED)
