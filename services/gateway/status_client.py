"""Reads of the status service, over HTTP (the gateway never reads its database)."""

from __future__ import annotations

import httpx

from services.gateway.errors import StatusUnavailable
from shared.contracts import TaskView


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
