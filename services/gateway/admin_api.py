"""Admin routes (`/admin/v1/...`), guarded by `ADMIN_API_KEY` as a bearer token."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, SecretStr, StrictBool, model_validator

from services.gateway.api import json_body, read_model
from services.gateway.deadletters import DeadLetterQueue, Walk
from services.gateway.errors import DatabaseUnavailable, Unavailable
from services.gateway.keys_api import ADMIN_BODY_LIMIT
from shared.bus import BROKER_ERRORS
from shared.http import ADMIN_PROBLEMS, Problem, admin_guard, problem_responses


class ReplayRequest(BaseModel):
    """Which dead letters to replay: `ids` (message or task ids) or `all`. Unknown fields are
    refused: an option this server does not know (`dry_run`) was ignored and the replay ran
    for real. `all` is strict: "false" is not a boolean."""

    model_config = ConfigDict(extra="forbid")

    ids: list[str] = Field(default_factory=list, max_length=10_000)
    all: StrictBool = False

    @model_validator(mode="after")
    def _one_selection(self) -> ReplayRequest:
        if self.all == bool(self.ids):
            raise ValueError("give either a non-empty `ids` or `all: true`")
        return self


def admin_routes(dead_letters: DeadLetterQueue, admin_key: SecretStr | None) -> APIRouter:
    router = APIRouter(
        prefix="/admin/v1",
        tags=["admin"],
        dependencies=[admin_guard(admin_key)],
        responses={**ADMIN_PROBLEMS, **problem_responses(503)},
    )

    @router.get("/dead-letters", summary="List the dead-letter queue")
    async def list_dead_letters() -> dict[str, Any]:
        with _broker_away_is_503():
            walk = await dead_letters.letters()
        return {
            "count": len(walk.letters),
            "truncated": walk.truncated,
            "items": [asdict(letter) for letter in walk.letters],
        }

    @router.get(
        "/dead-letters/{letter_id}",
        summary="One dead letter by message or task id",
        responses=problem_responses(404),
    )
    async def show_dead_letter(letter_id: str) -> dict[str, Any]:
        with _broker_away_is_503():
            walk = await dead_letters.letters()
        for letter in walk.letters:
            if letter.matches({letter_id}):
                return asdict(letter)
        raise Problem(404, f"No dead letter with message or task id {letter_id!r}{_unseen(walk)}.")

    @router.post(
        "/dead-letters/replay",
        summary="Send dead letters back with fresh attempts",
        openapi_extra=json_body(ReplayRequest),
        responses=problem_responses(400, 413, 415, 422),
    )
    async def replay_dead_letters(request: Request) -> dict[str, list[str]]:
        wanted = await read_model(request, ReplayRequest, what="replay", limit=ADMIN_BODY_LIMIT)
        with _broker_away_is_503():
            replay = await dead_letters.replay(None if wanted.all else wanted.ids)
        return asdict(replay)

    @router.delete("/dead-letters", summary="Purge the dead-letter queue")
    async def purge_dead_letters() -> dict[str, int]:
        with _broker_away_is_503():
            return {"purged": await dead_letters.purge()}

    return router


def _unseen(walk: Walk) -> str:
    if walk.truncated:
        return f" among the first {len(walk.letters)} (the queue holds more)"
    return " (a letter another gateway replica is looking at is out of sight meanwhile)"


@contextlib.contextmanager
def _broker_away_is_503() -> Iterator[None]:
    """The broker (or, for a replay, the database) away, blocked or refusing: a 503 to retry,
    not a 500. A replay cut short has sent some letters (each acked once its command was
    confirmed) and left the rest."""
    try:
        yield
    except (*BROKER_ERRORS, Unavailable) as error:
        away = "The database" if isinstance(error, DatabaseUnavailable) else "The broker"
        raise Problem(
            503,
            f"{away} is unavailable ({type(error).__name__}); try again shortly.",
            headers={"Retry-After": "5"},
        ) from error
