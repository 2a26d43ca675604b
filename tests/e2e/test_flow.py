"""End to end over HTTP against the four services running as separate processes."""

from __future__ import annotations

import uuid
from typing import Any

import httpx

from devtools.stack import Stack
from tests.support_sync import wait_for

RANK = {"scheduled": 0, "queued": 0, "processing": 1, "retrying": 1, "completed": 2, "failed": 2}
TASKS = 24


def test_every_accepted_text_is_scored_once_with_monotonic_states(
    stack: Stack, fake_llm_url: str, api_key: str
) -> None:
    markers = [f"e{uuid.uuid4().hex[:10]}" for _ in range(TASKS)]
    texts = [
        f"Essay {i}: queues decouple slow work from fast requests. [[id:{marker}]]"
        + (" [[fake:429x1:retry=1]]" if i % 6 == 0 else "")
        for i, marker in enumerate(markers)
    ]
    seen: dict[str, list[str]] = {}
    auth = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=stack.gateway_url, timeout=10, headers=auth) as client:
        task_ids = []
        for text in texts:
            response = client.post("/v1/scores", json={"text": text})
            assert response.status_code == 202, response.text
            task_id = response.json()["task_id"]
            first_poll = client.get(f"/v1/scores/{task_id}")
            assert first_poll.status_code == 200, "a poll right after the 202 must not be 404"
            seen[task_id] = [first_poll.json()["status"]]
            task_ids.append(task_id)

        def all_finished() -> bool:
            pending = [t for t in task_ids if RANK[seen[t][-1]] < 2]
            for task_id in pending:
                view = client.get(f"/v1/scores/{task_id}").json()
                seen[task_id].append(view["status"])
            return not [t for t in task_ids if RANK[seen[t][-1]] < 2]

        wait_for(all_finished, timeout_s=120, what="every task finished")
        views = [client.get(f"/v1/scores/{t}").json() for t in task_ids]

    for task_id, view in zip(task_ids, views, strict=True):
        ranks = [RANK[status] for status in seen[task_id]]
        assert ranks == sorted(ranks), f"{task_id} went backwards: {seen[task_id]}"
        assert view["status"] == "completed", view
        assert 0 <= view["result"]["score"] <= 10
    stats: dict[str, Any] = httpx.get(
        f"{fake_llm_url.removesuffix('/v1')}/_stats", timeout=10
    ).json()
    for i, marker in enumerate(markers):
        assert stats["by_id"][marker] == (2 if i % 6 == 0 else 1), marker


def test_the_internal_routes_of_the_running_services_need_the_stacks_internal_key(
    stack: Stack,
) -> None:
    """Each service reads `INTERNAL_API_KEY` from its environment, which the runner fills in:
    the polls above reached the status service with it; without it the routes refuse."""
    calls = {
        "status": "/internal/v1/tasks/unknown?tenant_id=default",
        "scheduler": "/internal/v1/usage?tenant_id=default&from=2030-01-01&to=2030-01-31",
        "notifier": "/internal/v1/tenants/default/failure-alert",
    }
    keyed = {"Authorization": f"Bearer {stack.internal_key}"}
    for service, path in calls.items():
        url = f"{stack.url(service)}{path}"
        assert httpx.get(url, timeout=10).status_code == 401, service
        assert httpx.get(url, headers=keyed, timeout=10).status_code in (200, 404), service
