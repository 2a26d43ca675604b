"""The benchmark's burst client waits out a gateway's 503s with `Retry-After`, as a
well-behaved client does, and counts them; other errors it reports at once."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web

from bench.load import http_session, post_until_admitted
from tests.support import serving

Answer = tuple[int, dict[str, str], bytes]


@asynccontextmanager
async def gateway(answers: list[Answer]) -> AsyncIterator[str]:
    """A stand-in gateway on a real port answering each POST with the next of `answers`."""

    async def handle(_: web.Request) -> web.Response:
        status, headers, body = answers.pop(0)
        return web.Response(status=status, headers=headers, body=body)

    app = web.Application()
    app.router.add_post("/v1/scores", handle)
    async with serving(app) as url:
        yield url


SHED: Answer = (503, {"Retry-After": "0"}, b'{"limit": "admission"}')
ACCEPTED: Answer = (202, {}, b'{"task_id": "t1"}')


async def test_a_shed_submission_is_sent_again_until_admitted() -> None:
    answers = [SHED, SHED, ACCEPTED]
    async with gateway(answers) as url, http_session(1) as session:
        posted = await post_until_admitted(session, url, "text", 0)
    assert posted.status == 202
    assert posted.task_id == "t1"
    assert posted.refusals == 2
    assert posted.error is None
    assert posted.due_at <= posted.sent_at  # latency runs from the first try
    assert answers == []


async def test_an_error_without_retry_after_is_reported_at_once() -> None:
    answers: list[Answer] = [(503, {}, b"down"), ACCEPTED]
    async with gateway(answers) as url, http_session(1) as session:
        posted = await post_until_admitted(session, url, "text", 0)
    assert posted.status == 503
    assert posted.task_id is None
    assert posted.refusals == 0
    assert answers == [ACCEPTED]
