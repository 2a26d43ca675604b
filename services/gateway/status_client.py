"""Reads of the status service, over HTTP (the gateway never reads its database)."""

from __future__ import annotations

import httpx

from services.gateway.errors import StatusUnavailable
from shared.contracts import BatchProgress, TaskHistory, TaskView


class StatusClient:
    def __init__(self, http: httpx.AsyncClient, *, base_url: str) -> None:
        self._http = http
        self._base_url = base_url.rstrip("/")

    async def find(self, task_id: str, *, tenant_id: str) -> TaskView | None:
        try:
            response = await self._http.get(
                f"{self._base_url}/internal/v1/tasks/{task_id}", params={"tenant_id": tenant_id}
            )
        except httpx.HTTPError as error:
            raise StatusUnavailable(f"status service unreachable: {error!r}") from error
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise StatusUnavailable(f"status service answered {response.status_code}")
        return TaskView.model_validate_json(response.content)

    async def history(self, task_id: str, *, tenant_id: str, after: int) -> TaskHistory | None:
        """The task's state changes after sequence `after`; None when unknown or expired."""
        response = await self._get(
            f"/internal/v1/tasks/{task_id}/history", {"tenant_id": tenant_id, "after": after}
        )
        if response is None:
            return None
        return TaskHistory.model_validate_json(response.content)

    async def batch(
        self, batch_id: str, *, tenant_id: str, after: int, limit: int
    ) -> BatchProgress:
        """Counts and a page (by `batch_index` after `after`) of the tasks the status knows."""
        response = await self._get(
            f"/internal/v1/batches/{batch_id}",
            {"tenant_id": tenant_id, "after": after, "limit": limit},
        )
        if response is None:
            return BatchProgress(batch_id=batch_id)
        return BatchProgress.model_validate_json(response.content)

    async def _get(self, path: str, params: dict[str, str | int]) -> httpx.Response | None:
        try:
            response = await self._http.get(f"{self._base_url}{path}", params=params)
        except httpx.HTTPError as error:
            raise StatusUnavailable(f"status service unreachable: {error!r}") from error
        if response.status_code == 404:
            return None
        if response.status_code != 200:
            raise StatusUnavailable(f"status service answered {response.status_code}")
        return response
