"""A task cancelled while it waits for its `delay_seconds`, end to end over HTTP against the
services running as separate processes: it fails with `cancelled` and the model never sees it.
"""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from devtools.stack import Stack
from tests.support_sync import wait_for

DELAY_S = 3


def _submitted(client: httpx.Client, marker: str) -> str:
    body = {"text": f"An essay [[id:{marker}]]", "delay_seconds": DELAY_S}
    response = client.post("/v1/scores", json=body)
    assert response.status_code == 202, response.text
    task_id: str = response.json()["task_id"]
    return task_id


def _final(client: httpx.Client, task_id: str) -> dict[str, Any] | None:
    view: dict[str, Any] = client.get(f"/v1/scores/{task_id}").json()
    return view if view["status"] in ("completed", "failed") else None


def test_a_delayed_task_cancelled_fails_as_cancelled_without_a_model_call(
    stack: Stack, fake_llm_url: str, api_key: str
) -> None:
    cancelled_marker, later_marker = (f"x{uuid.uuid4().hex[:10]}" for _ in range(2))
    auth = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=stack.gateway_url, timeout=10, headers=auth) as client:
        task_id = _submitted(client, cancelled_marker)
        response = client.post(f"/v1/scores/{task_id}/cancel")
        assert response.status_code == 202, response.text
        assert response.headers["Location"] == f"/v1/scores/{task_id}"

        view = wait_for(lambda: _final(client, task_id), timeout_s=60, what="cancelled")
        assert view["status"] == "failed", view
        assert view["error"]["code"] == "cancelled", view
        # Submitted after it with the same delay, so due after it: once it has run, the
        # cancelled task's command has been delivered too (and collided with its cancellation).
        later = _submitted(client, later_marker)
        done = wait_for(lambda: _final(client, later), timeout_s=60, what="the later task")
        assert done["status"] == "completed", done
        assert _final(client, task_id) == view
        again = client.post(f"/v1/scores/{task_id}/cancel")
        assert again.status_code == 409, again.text
    stats: dict[str, Any] = httpx.get(
        f"{fake_llm_url.removesuffix('/v1')}/_stats", timeout=10
    ).json()
    assert stats["by_id"].get(cancelled_marker, 0) == 0
    assert stats["by_id"][later_marker] == 1
