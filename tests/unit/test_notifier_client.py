"""The gateway's client of the notifier's tenant API: an answer it cannot read is the
notifier being unavailable, with a change perhaps made, never a 500."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx
import pytest

from services.gateway.webhooks_api import NotifierClient, NotifierUnavailable

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
