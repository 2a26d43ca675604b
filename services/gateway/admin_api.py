"""Admin routes (`/admin/v1/...`), guarded by `ADMIN_API_KEY` as a bearer token."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, Field, SecretStr, model_validator

from services.gateway.deadletters import DeadLetterQueue
from shared.http import Problem, admin_guard


class ReplayRequest(BaseModel):
    """Which dead letters to replay: `ids` (message or task ids) or `all`."""

    ids: list[str] = Field(default_factory=list, max_length=10_000)
    all: bool = False

    @model_validator(mode="after")
    def _one_selection(self) -> ReplayRequest:
        if self.all == bool(self.ids):
            raise ValueError("give either a non-empty `ids` or `all: true`")
        return self


def admin_routes(dead_letters: DeadLetterQueue, admin_key: SecretStr | None) -> APIRouter:
    router = APIRouter(prefix="/admin/v1", tags=["admin"], dependencies=[admin_guard(admin_key)])

    @router.get("/dead-letters", summary="List the dead-letter queue")
    async def list_dead_letters() -> dict[str, Any]:
        letters = await dead_letters.letters()
        return {"count": len(letters), "items": [asdict(letter) for letter in letters]}

    @router.get("/dead-letters/{letter_id}", summary="One dead letter by message or task id")
    async def show_dead_letter(letter_id: str) -> dict[str, Any]:
        for letter in await dead_letters.letters():
            if letter.matches({letter_id}):
                return asdict(letter)
        raise Problem(404, f"No dead letter with message or task id {letter_id!r}.")

    @router.post("/dead-letters/replay", summary="Send dead letters back with fresh attempts")
    async def replay_dead_letters(request: ReplayRequest) -> dict[str, list[str]]:
        replayed, skipped = await dead_letters.replay(None if request.all else request.ids)
        return {"replayed": replayed, "skipped_unreadable": skipped}

    @router.delete("/dead-letters", summary="Purge the dead-letter queue")
    async def purge_dead_letters() -> dict[str, int]:
        return {"purged": await dead_letters.purge()}

    return router
