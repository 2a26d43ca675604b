"""httpx over aiohttp (`httpx_aiohttp`), failing only with `httpx.HTTPError`s.

`httpx_aiohttp.AiohttpTransport` turns the aiohttp errors it lists into httpx's and lets any
other one escape as it is: among them `aiohttp.ClientResponseError`, what aiohttp raises for
an answer it cannot parse (a status line that is not HTTP, a header over its limit, malformed
chunks: a proxy's or a wrong port's answer). Our clients catch `httpx.HTTPError` to answer
503 "retry shortly", so such an answer became a 500. `MappedAiohttpTransport` maps every
aiohttp failure, of the request and of reading the body, in the one place all its clients
share: an unparsable answer is an `httpx.RemoteProtocolError`, any other aiohttp error an
`httpx.TransportError`.

It also bounds a request as a whole, the body's reading included (`total_timeout_s`):
`httpx_aiohttp` hands aiohttp httpx's connect and read timeouts only, each bounding one
wait, so a peer (or a proxy in front of it) sending its answer a few bytes at a time, each
within the read timeout, held the request, its caller's answer and a pooled connection for
as long as it went on (review of the status projection). Past the deadline the request
fails with `httpx.ReadTimeout`.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Iterator

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


async def _by[T](deadline: float, step: Awaitable[T], request: httpx.Request) -> T:
    """`step`, failing with `httpx.ReadTimeout` once the loop's clock passes `deadline`."""
    try:
        async with asyncio.timeout_at(deadline):
            return await step
    except TimeoutError as error:
        raise httpx.ReadTimeout("no whole answer within the deadline", request=request) from error


class _MappedStream(httpx.AsyncByteStream):
    """A response body whose reading fails with httpx errors only, and by the deadline."""

    def __init__(
        self, stream: httpx.AsyncByteStream, request: httpx.Request, deadline: float
    ) -> None:
        self._stream = stream
        self._request = request
        self._deadline = deadline

    async def __aiter__(self) -> AsyncIterator[bytes]:
        chunks = aiter(self._stream)
        while True:
            # Each chunk under the deadline alone: a timeout held across a `yield` would
            # cancel whatever the reader awaits meanwhile.
            with httpx_errors(self._request):
                try:
                    chunk = await _by(self._deadline, anext(chunks), self._request)
                except StopAsyncIteration:
                    return
            yield chunk

    async def aclose(self) -> None:
        with httpx_errors(self._request):
            await self._stream.aclose()


class MappedAiohttpTransport(AiohttpTransport):
    """`AiohttpTransport` whose every failure is an `httpx.HTTPError`, and whose every
    request, its body's reading included, ends within `total_timeout_s` (module
    docstring)."""

    def __init__(self, *, total_timeout_s: float, limits: httpx.Limits) -> None:
        super().__init__(limits=limits)
        self._total_timeout_s = total_timeout_s

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        deadline = asyncio.get_running_loop().time() + self._total_timeout_s
        with httpx_errors(request):
            response = await _by(deadline, super().handle_async_request(request), request)
        if isinstance(response.stream, httpx.AsyncByteStream):
            response.stream = _MappedStream(response.stream, request, deadline)
        return response
