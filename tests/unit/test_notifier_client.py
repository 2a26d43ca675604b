"""The gateway's client of the notifier's tenant API: an answer it cannot read is the
notifier being unavailable, with a change perhaps made, never a 500."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest
from aiohttp import web

from services.gateway.settings import GatewaySettings
from services.gateway.webhooks_api import NotifierClient, NotifierUnavailable, make_notifier_http
from tests.support import serving

PAGES = {
    "a proxy's page": httpx.Response(200, text="<html>Bad gateway</html>"),
    "another schema": httpx.Response(200, json={"signing_secret": "whsec_x"}),
    "a list": httpx.Response(200, json=["https://example.com/hook"]),
}


def client_answering(answer: httpx.Response) -> NotifierClient:
    transport = httpx.MockTransport(lambda request: answer)
    return NotifierClient(httpx.AsyncClient(transport=transport), base_url="http://notifier")


@pytest.mark.parametrize("answer", PAGES.values(), ids=PAGES.keys())
@pytest.mark.parametrize("call", ["signing_secret", "rotate_signing_secret", "failure_alert"])
async def test_an_unreadable_answer_is_the_notifier_unavailable_with_a_change_perhaps_made(
    answer: httpx.Response, call: str
) -> None:
    notifier = client_answering(answer)
    method: Callable[[str], Awaitable[object]] = getattr(notifier, call)
    with pytest.raises(NotifierUnavailable) as raised:
        await method("acme")
    assert raised.value.maybe_applied


async def test_the_notifier_is_reached_directly_whatever_proxy_the_environment_names(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The gateway asked the notifier, an internal service, through the egress proxy of its
    environment (HTTP_PROXY), which cannot reach it."""
    app = web.Application()
    app.router.add_get("/internal/v1/tenants/acme/webhook-secret", _secret)
    async with serving(app) as base_url:
        monkeypatch.setenv("HTTP_PROXY", "http://127.0.0.1:9")  # nothing listens: refused
        monkeypatch.setenv("ALL_PROXY", "http://127.0.0.1:9")
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        settings = GatewaySettings.model_validate({"NOTIFIER_URL": base_url})
        async with make_notifier_http(settings) as http:
            secret = await NotifierClient(http, base_url=base_url).signing_secret("acme")
    assert secret.secret == "whsec_direct"


async def _secret(request: web.Request) -> web.Response:
    return web.json_response({"secret": "whsec_direct", "created_at": "2030-01-01T00:00:00Z"})
