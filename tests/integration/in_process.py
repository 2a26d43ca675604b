"""Services run in-process on the test broker and database, as several modules set them up: a
scorer over the fake model (`scorer_over`), and the gateway with the status service it reads
(`gateway_and_status`)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass
from datetime import datetime

import httpx
from fastapi import FastAPI

from devtools.fake_llm import FakeLLM
from services.gateway.app import create_app as create_gateway
from services.gateway.settings import GatewaySettings
from services.scorer.app import create_app as create_scorer
from services.scorer.model.settings import ModelSettings
from services.scorer.settings import ScorerSettings
from services.status.app import create_app as create_status
from services.status.settings import StatusSettings
from shared.contracts import utcnow
from tests.support import running, stack_env


@dataclass(frozen=True)
class FakeModelScorer:
    """A scorer's settings against the fake model; `app()` wires one (not started)."""

    settings: ScorerSettings
    model_settings: ModelSettings

    def app(self) -> FastAPI:
        return create_scorer(self.settings, self.model_settings)


def scorer_over(
    llm: FakeLLM,
    *,
    amqp_url: str,
    mongo_url: str,
    db_prefix: str,
    llm_timeout_s: float = 10,
    **overrides: str,
) -> FakeModelScorer:
    """A scorer calling `llm`, with the settings of `stack_env` (no gateway: no API key) and
    `overrides` by name."""
    env = stack_env(
        amqp_url=amqp_url,
        mongo_url=mongo_url,
        db_prefix=db_prefix,
        llm_url=llm.url,
        api_key="unused",
        llm_timeout_s=llm_timeout_s,
        **overrides,
    )
    return FakeModelScorer(ScorerSettings.model_validate(env), ModelSettings.model_validate(env))


@dataclass
class GatewayAndStatus:
    api: httpx.AsyncClient  # the gateway's, with `api_key` as its bearer token when given
    status: httpx.AsyncClient  # the status service's: what the gateway reads it through
    gateway: FastAPI


@asynccontextmanager
async def gateway_and_status(
    env: Mapping[str, object],
    *,
    api_key: str | None = None,
    clock: Callable[[], datetime] = utcnow,
) -> AsyncIterator[GatewayAndStatus]:
    """The status service running, then the gateway reading it, both on `env` and `clock`;
    stopped in the reverse order."""
    async with running(create_status(StatusSettings.model_validate(env), clock=clock)) as status:
        gateway = create_gateway(
            GatewaySettings.model_validate(env), status_http=status, clock=clock
        )
        async with running(gateway) as api:
            if api_key is not None:
                api.headers["Authorization"] = f"Bearer {api_key}"
            yield GatewayAndStatus(api, status, gateway)
