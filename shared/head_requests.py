"""HEAD answered wherever GET is (RFC 9110 §9.3.2: a server that answers GET answers HEAD):
FastAPI's routes answer only the methods they name, so `HEAD /v1/scores/{id}` was a 405.

The request goes to the app as a GET (its authentication, rate limit and reads included,
as a GET's would), and only the answer's head goes back: status and headers, the GET's
`Content-Length` kept. A streamed answer (the SSE route) ends with its head: once the
answer is complete the server tells the app that the client is gone (ASGI: `receive`
after the response is sent), so the stream's generator closes instead of running on for a
client that expects no body, on a connection it would hold."""

from __future__ import annotations

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

_NO_BODY: Message = {"type": "http.response.body", "body": b"", "more_body": False}
# Set in the scope of a HEAD run as a GET.
HEAD_SCOPE_KEY = "scorebox.head"


class HeadAsGet:
    """ASGI middleware: HEAD runs the GET route and sends its head alone."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return
        head = {**scope, "method": "GET", HEAD_SCOPE_KEY: True}
        await self.app(head, receive, _HeadOnly(send).send)


def asked_head_only(request: Request) -> bool:
    """Whether the GET being answered is a HEAD's: a route whose GET changes something (the
    webhook secret, created at its first read) skips that for a HEAD, a safe method."""
    return bool(request.scope.get(HEAD_SCOPE_KEY))


class _HeadOnly:
    """What one HEAD request sends: the head, then an empty body in place of the first part
    of the GET's, and nothing after."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._answered = False

    async def send(self, message: Message) -> None:
        if self._answered:
            return
        if message["type"] == "http.response.start":
            await self._send(message)
            return
        # The first part of the body (or whatever follows the head) ends the answer.
        self._answered = True
        await self._send(_NO_BODY)


def answer_head_as_get(app: Starlette) -> None:
    """Install `HeadAsGet` on `app`, outermost: added after every other middleware, so they
    see the request as the GET it runs as (the metrics count it under GET's route)."""
    app.add_middleware(HeadAsGet)
