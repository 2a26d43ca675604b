"""httpx over aiohttp (`httpx_aiohttp`), failing only with `httpx.HTTPError`s.

`httpx_aiohttp.AiohttpTransport` turns the aiohttp errors it lists into httpx's and lets any
other one escape as it is: among them `aiohttp.ClientResponseError`, what aiohttp raises for
an answer it cannot parse (a status line that is not HTTP, a header over its limit, malformed
chunks: a proxy's or a wrong port's answer). Our clients catch `httpx.HTTPError` to answer
503 "retry shortly", so such an answer became a 500. `MappedAiohttpTransport` maps every
aiohttp failure, of the request and of reading the body, in the one place all its clients
share: an unparsable answer is an `httpx.RemoteProtocolError`, any other aiohttp error an
`httpx.TransportError`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Iterator

import aiohttp
import httpx
from aiohttp.http_exceptions import HttpProcessingError
from httpx_aiohttp import AiohttpTransport


@contextlib.contextmanager
def httpx_errors(request: httpx.Request) -> Iterator[None]:
    """Raise aiohttp's failures of `request` as the httpx errors its callers catch."""
    try:
        yield
    except (aiohttp.ClientResponseError, HttpProcessingError) as error:
        raise httpx.RemoteProtocolError(
            f"unparsable answer: {_described(error)}", request=request
        ) from error
    except aiohttp.ClientError as error:
        raise httpx.TransportError(_described(error), request=request) from error


def _described(error: Exception) -> str:
    """The error's type and text, never its repr: a `ClientResponseError`'s repr holds the
    request's headers, the internal key among them, and our callers log the message."""
    return f"{type(error).__name__}: {error}"


class _MappedStream(httpx.AsyncByteStream):
    """A response body whose reading fails with httpx errors only."""

    def __init__(self, stream: httpx.AsyncByteStream, request: httpx.Request) -> None:
        self._stream = stream
        self._request = request

    async def __aiter__(self) -> AsyncIterator[bytes]:
        with httpx_errors(self._request):
            async for chunk in self._stream:
                yield chunk

    async def aclose(self) -> None:
        with httpx_errors(self._request):
            await self._stream.aclose()


class MappedAiohttpTransport(AiohttpTransport):
    """`AiohttpTransport` whose every failure is an `httpx.HTTPError` (module docstring)."""

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        with httpx_errors(request):
            response = await super().handle_async_request(request)
        if isinstance(response.stream, httpx.AsyncByteStream):
            response.stream = _MappedStream(response.stream, request)
        return response
