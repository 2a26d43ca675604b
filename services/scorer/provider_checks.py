"""Checks of the provider that are no text's call: the throttle's probe of an outage when
no delivery whose call would be news of the provider waits (`ModelThrottle._checks_first`)."""

from __future__ import annotations

import logging

from services.scorer.errors import ModelRateLimited, ScoringError, TransientError
from services.scorer.metrics import ScorerMetrics
from services.scorer.model import ScoreModel
from services.scorer.throttle import CheckProvider, ProviderCheck, ProviderFound

log = logging.getLogger("scorebox.scorer.throttle")


def provider_checks(model: ScoreModel, metrics: ScorerMetrics) -> CheckProvider:
    """What `model.check(named)` found, counted by what it was."""

    async def check_provider(named: str | None) -> ProviderCheck:
        check = await _checked(model, named)
        metrics.provider_checks.labels(check.found.value).inc()
        return check

    return check_provider


async def _checked(model: ScoreModel, named: str | None) -> ProviderCheck:
    try:
        await model.check(named)
    except ModelRateLimited as error:
        return ProviderCheck(ProviderFound.RATE_LIMITED, error.retry_after_s)
    except TransientError as error:
        if error.provider_down:
            return ProviderCheck(ProviderFound.UNAVAILABLE, error.retry_after_s)
        return ProviderCheck(ProviderFound.ANSWERED)
    except ScoringError:
        return ProviderCheck(ProviderFound.ANSWERED)  # refused: the provider is up
    except Exception:
        # A defect of the check, not news of the provider: the pause ends, and the texts'
        # own calls tell. Taken for the provider down, it would hold every call for as long.
        log.exception("a check of the provider failed; taken as answered")
    return ProviderCheck(ProviderFound.ANSWERED)
