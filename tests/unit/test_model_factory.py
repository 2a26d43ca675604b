import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from yarl import URL

from services.scorer.app import (
    lease_warning,
    longest_hold_s,
    refuse_a_hold_past_the_consumer_timeout,
)
from services.scorer.errors import ModelUnavailable
from services.scorer.model import (
    HeuristicModel,
    ModelSettings,
    OpenAIChatModel,
    ProviderClient,
    ScoringRequest,
    build_model,
    make_http_client,
    provider_connector,
)
from services.scorer.model.http_client import MAX_REPLY_BYTES, ReplyTooLarge
from services.scorer.model.settings import MAX_LLM_TIMEOUT_S
from services.scorer.settings import MAX_LEASE_MARGIN_S, ScorerSettings
from shared.settings import BROKER_CONSUMER_TIMEOUT_S, StartupRefused
from tests.support import serving

LLM_VARIABLES = [
    "LLM_PROVIDER",
    "LLM_BASE_URL",
    "LLM_API_KEY",
    "LLM_MODEL",
    "LLM_TIMEOUT_S",
    "LLM_MAX_INPUT_CHARS",
    "LLM_MAX_OUTPUT_TOKENS",
    "LLM_JSON_MODE",
]


@pytest.fixture
def clean_environment(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in LLM_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_settings_defaults(clean_environment: pytest.MonkeyPatch) -> None:
    settings = ModelSettings()
    assert settings.llm_provider == "heuristic"
    assert settings.llm_base_url == "https://api.openai.com/v1"
    assert settings.llm_api_key.get_secret_value() == ""
    assert settings.llm_model == "gpt-4o-mini"
    assert settings.llm_timeout_s == 30
    assert settings.llm_max_input_chars == 6000
    assert settings.llm_max_output_tokens == 300
    assert settings.llm_json_mode == "json_schema"


def test_settings_read_the_llm_variables(clean_environment: pytest.MonkeyPatch) -> None:
    clean_environment.setenv("LLM_PROVIDER", "openai")
    clean_environment.setenv("LLM_API_KEY", "sk-secret")
    clean_environment.setenv("LLM_TIMEOUT_S", "2.5")
    clean_environment.setenv("LLM_JSON_MODE", "none")
    settings = ModelSettings()
    assert settings.llm_provider == "openai"
    assert settings.llm_timeout_s == 2.5
    assert settings.llm_json_mode == "none"
    assert "sk-secret" not in repr(settings)


@pytest.mark.parametrize(
    ("name", "value"),
    [("LLM_PROVIDER", "anthropic"), ("LLM_JSON_MODE", "xml"), ("LLM_TIMEOUT_S", "0")],
)
def test_settings_refuse_unknown_values(
    clean_environment: pytest.MonkeyPatch, name: str, value: str
) -> None:
    clean_environment.setenv(name, value)
    with pytest.raises(ValueError, match=name):
        ModelSettings()


def test_each_timeout_of_a_held_redelivery_is_bounded() -> None:
    with pytest.raises(ValueError, match="LLM_TIMEOUT_S"):
        ModelSettings(LLM_TIMEOUT_S=MAX_LLM_TIMEOUT_S + 1)
    with pytest.raises(ValueError, match="LEASE_MARGIN_S"):
        ScorerSettings.model_validate({"LEASE_MARGIN_S": MAX_LEASE_MARGIN_S + 1})


def test_the_longest_timeout_with_the_other_defaults_holds_inside_the_consumer_timeout() -> None:
    settings = ScorerSettings.model_validate({})
    model_settings = ModelSettings(LLM_TIMEOUT_S=MAX_LLM_TIMEOUT_S)
    refuse_a_hold_past_the_consumer_timeout(settings, model_settings)
    assert longest_hold_s(settings, model_settings) < BROKER_CONSUMER_TIMEOUT_S


@pytest.mark.parametrize(
    "values",
    [
        {"LEASE_MARGIN_S": MAX_LEASE_MARGIN_S},
        {"RATE_LIMIT_HOLD_S": 600},
    ],
    ids=["the longest margin", "the longest rate-limit hold"],
)
def test_settings_that_hold_a_redelivery_past_the_consumer_timeout_are_refused(
    values: dict[str, float],
) -> None:
    """A redelivery waits out another worker's claim, then its turn under a rate limit's
    pause, then takes a delivery's whole path, unacknowledged all along: past RabbitMQ's
    consumer timeout the broker takes back every delivery of the channel. Only
    LLM_TIMEOUT_S was bounded, with the claim and the call alone counted (review)."""
    settings = ScorerSettings.model_validate(values)
    model_settings = ModelSettings(LLM_TIMEOUT_S=MAX_LLM_TIMEOUT_S)
    with pytest.raises(StartupRefused, match="consumer timeout"):
        refuse_a_hold_past_the_consumer_timeout(settings, model_settings)


def test_a_lease_too_short_for_the_steps_under_the_claim_is_warned_of() -> None:
    settings = ScorerSettings.model_validate({"LEASE_MARGIN_S": "1"})
    warning = lease_warning(settings, ModelSettings(LLM_TIMEOUT_S=5))
    assert warning is not None
    assert "LEASE_MARGIN_S to at least 25" in warning
    assert lease_warning(ScorerSettings.model_validate({}), ModelSettings()) is None


def _settings(**values: Any) -> ModelSettings:
    return ModelSettings(**{"LLM_TIMEOUT_S": 5, **values})


def test_the_heuristic_provider_needs_no_http_client() -> None:
    model = build_model(_settings(LLM_PROVIDER="heuristic"), None)
    assert isinstance(model, HeuristicModel)
    assert model.name == "heuristic-v1"


async def test_the_openai_provider_uses_the_given_client() -> None:
    async with ProviderClient(concurrency=1, timeout_s=5) as http:
        model = build_model(_settings(LLM_PROVIDER="openai", LLM_MODEL="m-1"), http)
    assert isinstance(model, OpenAIChatModel)
    assert model.name == "m-1"


def test_the_openai_provider_without_a_client_is_a_configuration_error() -> None:
    with pytest.raises(ValueError, match="HTTP client"):
        build_model(_settings(LLM_PROVIDER="openai"), None)


@pytest.mark.parametrize("concurrency", [1, 64, 256])
async def test_the_pool_holds_one_connection_per_concurrent_score(concurrency: int) -> None:
    connector = provider_connector(concurrency=concurrency)
    try:
        assert connector.limit == concurrency
        assert connector.limit_per_host == 0  # unbounded: the total limit applies
    finally:
        await connector.close()


def test_the_pool_needs_room_for_one_request() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        ProviderClient(concurrency=0, timeout_s=5)


def test_the_client_has_explicit_timeouts_behind_the_models_deadline() -> None:
    client = make_http_client(_settings(LLM_TIMEOUT_S=30), concurrency=8)
    assert client.timeout == aiohttp.ClientTimeout(total=31, connect=10)
    client = make_http_client(_settings(LLM_TIMEOUT_S=2), concurrency=8)
    assert client.timeout == aiohttp.ClientTimeout(total=3, connect=2)


def _closed_local_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
    return port


async def test_a_refused_connection_through_the_real_transport_is_unavailability() -> None:
    settings = _settings(
        LLM_PROVIDER="openai", LLM_BASE_URL=f"http://127.0.0.1:{_closed_local_port()}/v1"
    )
    async with make_http_client(settings, concurrency=2) as http:
        model = OpenAIChatModel(http, settings)
        with pytest.raises(ModelUnavailable, match="cannot reach"):
            await model.score(
                ScoringRequest(task_id="t", text="An essay.", rubric=None, model=None)
            )


@pytest.fixture
async def cookie_setting_server() -> AsyncIterator[tuple[str, list[str | None]]]:
    """A real HTTP server that sets a cookie on every answer and notes the Cookie it got."""
    received: list[str | None] = []

    async def answer(request: web.Request) -> web.Response:
        received.append(request.headers.get("Cookie"))
        response = web.json_response({"ok": True})
        response.set_cookie("affinity", "node-7", path="/")
        return response

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    async with serving(app) as url:
        # By a name: aiohttp's default jar takes no cookies from a bare IP address.
        by_name = url.replace("127.0.0.1", "localhost")
        yield f"{by_name}/v1/chat/completions", received


async def test_the_client_keeps_no_cookie_between_requests(
    cookie_setting_server: tuple[str, list[str | None]],
) -> None:
    url, received = cookie_setting_server
    async with make_http_client(_settings(), concurrency=2) as http:
        for _ in range(2):
            reply = await http.post(URL(url), body=b"{}", headers={})
            assert reply.headers["set-cookie"].startswith("affinity=node-7")
    assert received == [None, None]


@pytest.fixture
async def streaming_server() -> AsyncIterator[str]:
    """A real HTTP server answering in chunks, without a Content-Length: `?size=` bytes."""

    async def answer(request: web.Request) -> web.StreamResponse:
        size = int(request.query["size"])
        if "gzip" in request.query:
            compressed = web.Response(body=b"x" * size)
            compressed.enable_compression(web.ContentCoding.gzip)
            return compressed
        response = web.StreamResponse()
        response.enable_chunked_encoding()
        await response.prepare(request)
        for start in range(0, size, 64 * 1024):
            await response.write(b"x" * min(64 * 1024, size - start))
        await response.write_eof()
        return response

    app = web.Application()
    app.router.add_post("/answer", answer)
    async with serving(app) as url:
        yield f"{url}/answer"


async def test_a_streamed_answer_is_read_up_to_the_limit(streaming_server: str) -> None:
    async with make_http_client(_settings(), concurrency=1) as http:
        at_limit = await http.post(
            URL(streaming_server).with_query(size=MAX_REPLY_BYTES), body=b"{}", headers={}
        )
        assert len(at_limit.body) == MAX_REPLY_BYTES
        with pytest.raises(ReplyTooLarge):
            await http.post(
                URL(streaming_server).with_query(size=MAX_REPLY_BYTES + 1), body=b"{}", headers={}
            )


async def test_a_compressed_answer_is_counted_as_it_inflates(streaming_server: str) -> None:
    bomb = URL(streaming_server).with_query(size=MAX_REPLY_BYTES + 1, gzip="")
    async with make_http_client(_settings(), concurrency=1) as http:
        with pytest.raises(ReplyTooLarge):
            await http.post(bomb, body=b"{}", headers={})
        fits = await http.post(bomb.update_query(size=1000), body=b"{}", headers={})
        assert fits.body == b"x" * 1000


@pytest.mark.parametrize(("retention_s", "accepted"), [(86_400, False), (2 * 86_400, True)])
def test_the_attempts_are_kept_at_least_as_long_as_a_retry_may_wait(
    retention_s: int, accepted: bool
) -> None:
    """A retry the provider asked to wait a day for, claimed after its task's record expired,
    called the model again, also for a task cancelled meanwhile (found in review)."""
    settings = {"ATTEMPTS_RETENTION_S": retention_s}
    if accepted:
        assert ScorerSettings.model_validate(settings).attempts_retention_s == retention_s
    else:
        with pytest.raises(ValueError, match="ATTEMPTS_RETENTION_S"):
            ScorerSettings.model_validate(settings)
