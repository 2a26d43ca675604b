"""Client CPU per model call, against the fake OpenAI-compatible model (`devtools.fake_llm`).

Five ways make the same `POST /chat/completions` (`CALLS` calls, `IN_FLIGHT` at once, as a
scorer of concurrency 64 does), and the process's CPU time per call is reported:

- the scorer's model adapter (`OpenAIChatModel.score`: prompt, request, parsing and
  validation of the verdict) on its HTTP client (`make_http_client`), on the benchmark's
  essays;
- the same HTTP client posting a fixed body to the same parsed URL (the client alone);
- httpx's API over aiohttp's pool (`httpx-aiohttp`, what the scorer used before);
- httpx's own pool (`httpx.AsyncClient` with limits sized to the calls in flight);
- bare aiohttp (`ClientSession`), the floor.

The ways alternate `ROUNDS` times and the median of each is reported.
"""

from __future__ import annotations

import functools

import aiohttp
import httpx
import orjson
from httpx_aiohttp import AiohttpTransport
from yarl import URL

from bench.load import essay
from bench.stats import alternating_medians, cpu_us_each
from services.scorer.model import ScoringRequest, build_model, make_http_client
from services.scorer.model.prompt import build_messages
from services.scorer.model.settings import ModelSettings

CALLS = 2_000
IN_FLIGHT = 64
ROUNDS = 3
TIMEOUT_S = 30.0

HEADERS = {"Content-Type": "application/json", "Authorization": "Bearer bench"}


def _settings(base_url: str) -> ModelSettings:
    return ModelSettings.model_validate(
        {"LLM_PROVIDER": "openai", "LLM_BASE_URL": base_url, "LLM_API_KEY": "bench"}
    )


def _completions(base_url: str) -> httpx.URL:
    return httpx.URL(f"{base_url}/chat/completions")


def _body(settings: ModelSettings) -> bytes:
    messages = build_messages(essay("model-call", 0), None, truncated=False)
    return orjson.dumps({"model": settings.llm_model, "messages": messages, "temperature": 0})


async def through_the_adapter(base_url: str) -> float:
    settings = _settings(base_url)
    essays = [essay("model-call", index) for index in range(CALLS)]
    async with make_http_client(settings, concurrency=IN_FLIGHT) as http:
        model = build_model(settings, http)

        async def call(i: int) -> None:
            await model.score(ScoringRequest(task_id=str(i), text=essays[i]))

        return await cpu_us_each(CALLS, IN_FLIGHT, call)


async def _httpx_posts(client: httpx.AsyncClient, url: httpx.URL, body: bytes) -> float:
    async def call(_: int) -> None:
        response = await client.post(url, content=body, headers=HEADERS)
        response.raise_for_status()
        orjson.loads(response.content)

    return await cpu_us_each(CALLS, IN_FLIGHT, call)


async def the_client_alone(base_url: str) -> float:
    settings = _settings(base_url)
    url, body = URL(f"{base_url}/chat/completions"), _body(settings)
    async with make_http_client(settings, concurrency=IN_FLIGHT) as client:

        async def call(_: int) -> None:
            reply = await client.post(url, body=body, headers=HEADERS)
            if not reply.is_success:
                raise RuntimeError(f"the fake model answered {reply.status}")
            orjson.loads(reply.body)

        return await cpu_us_each(CALLS, IN_FLIGHT, call)


def _limits() -> httpx.Limits:
    return httpx.Limits(max_connections=IN_FLIGHT, max_keepalive_connections=IN_FLIGHT)


async def httpx_on_aiohttp(base_url: str) -> float:
    transport = AiohttpTransport(limits=_limits(), retries=0)
    async with httpx.AsyncClient(transport=transport, timeout=TIMEOUT_S) as client:
        return await _httpx_posts(client, _completions(base_url), _body(_settings(base_url)))


async def httpx_own_pool(base_url: str) -> float:
    async with httpx.AsyncClient(limits=_limits(), timeout=TIMEOUT_S) as client:
        body = _body(_settings(base_url))
        return await _httpx_posts(client, _completions(base_url), body)


async def bare_aiohttp(base_url: str) -> float:
    body = _body(_settings(base_url))
    url = str(_completions(base_url))
    connector = aiohttp.TCPConnector(limit=IN_FLIGHT)
    timeout = aiohttp.ClientTimeout(total=TIMEOUT_S)
    async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:

        async def call(_: int) -> None:
            async with session.post(url, data=body, headers=HEADERS) as response:
                response.raise_for_status()
                orjson.loads(await response.read())

        return await cpu_us_each(CALLS, IN_FLIGHT, call)


async def model_call_cost(base_url: str) -> None:
    ways = (through_the_adapter, the_client_alone, httpx_on_aiohttp, httpx_own_pool, bare_aiohttp)
    medians = await alternating_medians(ROUNDS, *(functools.partial(way, base_url) for way in ways))
    adapter, client, httpx_aiohttp, own_pool, floor = medians
    print(
        f"client CPU per model call ({IN_FLIGHT} in flight, median of {ROUNDS}): scorer's "
        f"adapter {adapter:.0f} µs; its HTTP client {client:.0f} µs; httpx on aiohttp "
        f"{httpx_aiohttp:.0f} µs; httpx's own pool {own_pool:.0f} µs; bare aiohttp {floor:.0f} µs"
    )
