"""The HTTP client of model providers: aiohttp's connection pool, sized to the concurrency."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import TracebackType
from typing import Final, Self

import aiohttp
from aiohttp.helpers import get_env_proxy_for_url
from yarl import URL

from services.scorer.model.settings import ModelSettings

_CONNECT_TIMEOUT_S: Final = 10.0
# A verdict is a few hundred tokens; an answer this large is a provider gone wrong, and
# reading it whole would let one reply take the scorer's memory.
MAX_REPLY_BYTES: Final = 1 << 20
# The request's own bound comes this long after the caller's deadline of the same length, so
# that a caller's deadline is the one that fires and names itself.
_BACKSTOP_MARGIN_S: Final = 1.0


class ReplyTooLarge(Exception):
    """The provider's answer went beyond `MAX_REPLY_BYTES`; the rest of it was not read.
    `status`: the answer's HTTP status (a gateway's error page may be that large)."""

    def __init__(self, message: str, *, status: int) -> None:
        super().__init__(message)
        self.status = status


@dataclass(frozen=True, slots=True)
class ProviderReply:
    """One HTTP response of a provider, read in full. `headers` ignore case."""

    status: int
    reason: str
    headers: Mapping[str, str]
    body: bytes

    @property
    def is_success(self) -> bool:
        return 200 <= self.status < 300

    @property
    def text(self) -> str:
        return self.body.decode("utf-8", errors="replace")


class ProviderClient:
    """Posts JSON bodies to a provider, with up to `concurrency` requests at once.

    It is aiohttp with nothing on top: httpx's API over the same pool cost more CPU per call
    than the whole aiohttp request (docs/architecture.md, "The model call"). Each request must
    end within `timeout_s` and a second, and connect within 10 s: a backstop behind the hard
    deadline of `timeout_s` that `OpenAIChatModel` sets around each score, which fires first
    and names itself. It follows no redirects, keeps no cookies (a model API is stateless,
    and a provider's affinity cookie must not tie one task's request to another's) and never
    retries: the scorer owns retries, through the broker. Nothing connects before the first
    request, so it may be built outside the event loop; the owner closes it with `aclose()`.
    """

    def __init__(
        self, *, concurrency: int, timeout_s: float, proxy: EnvProxy | None = None
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"concurrency must be at least 1, got {concurrency}")
        self.concurrency = concurrency
        self.timeout = aiohttp.ClientTimeout(
            total=timeout_s + _BACKSTOP_MARGIN_S, connect=min(timeout_s, _CONNECT_TIMEOUT_S)
        )
        self.proxy = proxy
        self._session: aiohttp.ClientSession | None = None

    async def post(self, url: URL, *, body: bytes, headers: Mapping[str, str]) -> ProviderReply:
        """POST `body`; raises aiohttp's errors (`aiohttp.ClientError`, `TimeoutError`) and
        `ReplyTooLarge`."""
        async with self._opened().post(
            url, data=body, headers=headers, allow_redirects=False
        ) as response:
            content = await _read_bounded(response)
            return ProviderReply(response.status, response.reason or "", response.headers, content)

    def _opened(self) -> aiohttp.ClientSession:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                connector=provider_connector(concurrency=self.concurrency),
                timeout=self.timeout,
                cookie_jar=aiohttp.DummyCookieJar(),
                proxy=None if self.proxy is None else self.proxy.url,
                proxy_auth=None if self.proxy is None else self.proxy.auth,
            )
        return self._session

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()


async def _read_bounded(response: aiohttp.ClientResponse) -> bytes:
    announced = response.content_length
    if announced is not None and announced > MAX_REPLY_BYTES:
        raise ReplyTooLarge(f"the provider announced {announced} bytes", status=response.status)
    if announced is not None and "Content-Encoding" not in response.headers:
        # The parser reads no more than the Content-Length announces; a compressed body is
        # counted as it inflates instead, below.
        return await response.read()
    content = bytearray()
    async for chunk in response.content.iter_any():
        content += chunk
        if len(content) > MAX_REPLY_BYTES:
            raise ReplyTooLarge(
                f"the provider sent more than {MAX_REPLY_BYTES} bytes", status=response.status
            )
    return bytes(content)


def provider_connector(*, concurrency: int) -> aiohttp.TCPConnector:
    """A pool of `concurrency` connections; left unset, aiohttp would cap it at 100.

    `limit_per_host` stays unbounded so that the total limit is the one that applies.
    Call it inside the event loop.
    """
    return aiohttp.TCPConnector(limit=concurrency, limit_per_host=0)


@dataclass(frozen=True, slots=True)
class EnvProxy:
    url: URL
    auth: aiohttp.BasicAuth | None


def env_proxy_for(url: URL) -> EnvProxy | None:
    """The proxy that HTTPS_PROXY / HTTP_PROXY / NO_PROXY name for `url` (as the OpenAI SDK
    honours them: the provider is outside, and egress often goes through a proxy), read once.

    Not aiohttp's `trust_env`, which reads the environment and `~/.netrc` again on every
    request, each in a thread of the default executor (two hops per model call, a tenth of
    the scorer's CPU), and takes a `~/.netrc` entry for the provider's host as credentials
    that clash with the API key's `Authorization` header: every call then failed."""
    try:
        proxy, auth = get_env_proxy_for_url(url)
    except LookupError:
        return None
    return EnvProxy(proxy, auth)


def make_http_client(settings: ModelSettings, *, concurrency: int) -> ProviderClient:
    """The client for `settings`' provider, able to hold `concurrency` requests at once,
    through the proxy the environment names for it."""
    return ProviderClient(
        concurrency=concurrency,
        timeout_s=settings.llm_timeout_s,
        proxy=env_proxy_for(URL(settings.llm_base_url)),
    )
