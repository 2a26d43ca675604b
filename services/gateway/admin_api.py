"""Admin routes (`/admin/v1/...`), guarded by `ADMIN_API_KEY` as a bearer token."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, Field, SecretStr

from services.gateway.deadletters import (
    DeadLetter,
    DeadLetterQueue,
    ShownLetter,
    Walk,
    unavailable_detail,
)
from services.gateway.errors import Unavailable, refused_for_good
from services.gateway.keys_api import ADMIN_BODY_LIMIT
from shared.bodies import json_body, read_model
from shared.bus import BROKER_ERRORS
from shared.contracts import rfc3339
from shared.dead_letter_routes import add_removal_routes, refuse_a_read_of_the_replay
from shared.dead_letters import (
    REPLAY_BUDGET_S,
    WALK_BOUND,
    ReplayRequest,
)
from shared.http import (
    ADMIN_PROBLEMS,
    Problem,
    admin_guard,
    database_refused,
    problem_responses,
    quoted,
)

# What no walk sees: the letters another walk holds at that moment (each walk holds every
# letter it reaches until it ends).
OUT_OF_SIGHT = (
    "a letter another walk holds at that moment is out of sight: a walk of another gateway "
    "replica, or the scheduler's dead-letter depth probe, which takes the head of the "
    "queue for a moment"
)


class ReplayReport(BaseModel):
    replayed: list[str] = Field(description="Task ids sent again, one per letter replayed.")
    skipped_unreadable: list[str] = Field(
        description="Message ids of letters that hold no score request, kept."
    )
    superseded: list[str] = Field(
        default_factory=list,
        description="Task ids of letters a later generation of their task superseded (a "
        "re-score handed one out since), removed without being sent: replayed, each scored "
        "its task once more. One per letter.",
    )
    skipped_being_rescored: list[str] = Field(
        default_factory=list,
        description="Task ids of letters kept because a re-score of their task was being "
        "sent at that moment: replayed beside it, each scored its task twice. Replay them "
        "again shortly: once the re-score is sent they are superseded, and one that has not "
        "tried to send for an hour (its request dead-lettered) no longer keeps them. One per "
        "letter.",
    )
    not_found: list[str] = Field(
        description="Ids asked for that no letter matched, the walk having reached the end of "
        f"the queue ({OUT_OF_SIGHT})."
    )
    not_reached: list[str] = Field(
        description="Ids asked for that no letter matched before the walk stopped at its bound "
        "(`truncated`): they may name letters past it (replay or drop letters before them, "
        "then ask again); and those of letters the replay's budget left (`timed_out`: ask "
        "again)."
    )
    truncated: bool = Field(
        description=f"The walk stopped at its bound ({WALK_BOUND}) with letters left behind "
        "it: `all` replayed only the letters it reached; ids it did not match are "
        "`not_reached`, never `not_found`."
    )
    timed_out: bool = Field(
        default=False,
        description=f"The replay stopped at its {REPLAY_BUDGET_S:.0f} s budget with letters it "
        "had matched left in the queue: ask again for the rest.",
    )
    interrupted: str | None = Field(
        default=None,
        description="Why the replay stopped early, null when it did not: the broker or the "
        "database failed after some letters were handled (those above). The letters it "
        "matched and did not handle are left in the queue, their ids `not_reached`: ask "
        "again for the rest, shortly, or once a refusal for good is mended (it says which). "
        "A letter sent whose ack failed counts as replayed and stays in the queue: replayed "
        "again, it is sent as the same generation, scored once. (A failure before any letter "
        "was handled answers 503, or 500 `database-refused`.)",
    )


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
            # A cut-off for a drop or a purge that keeps what this listing did not show.
            "listed_at": rfc3339(walk.listed_at),
            "items": [_letter_view(letter) for letter in walk.letters],
        }

    @router.get(
        "/dead-letters/{letter_id}",
        summary="One dead letter by message or task id, with its whole body",
        responses=problem_responses(404, 405),
    )
    async def show_dead_letter(request: Request, letter_id: str) -> dict[str, Any]:
        refuse_a_read_of_the_replay(request, letter_id)
        with _broker_away_is_503():
            found = await dead_letters.shown(letter_id)
        if isinstance(found, ShownLetter):
            return {**_letter_view(found.letter), "body": found.body}
        raise Problem(
            404, f"No dead letter with message or task id {quoted(letter_id)}{_unseen(found)}."
        )

    @router.post(
        "/dead-letters/replay",
        summary="Send dead letters back with fresh attempts",
        openapi_extra=json_body(ReplayRequest),
        response_model=ReplayReport,
        responses=problem_responses(400, 413, 415, 422),
    )
    async def replay_dead_letters(request: Request) -> ReplayReport:
        wanted = await read_model(request, ReplayRequest, what="replay", limit=ADMIN_BODY_LIMIT)
        with _broker_away_is_503():
            replay = await dead_letters.replay(None if wanted.all else wanted.ids)
        return ReplayReport(**asdict(replay))

    add_removal_routes(
        router,
        dead_letters,
        path="/dead-letters",
        named_by="message or task id",
        out_of_sight=OUT_OF_SIGHT,
        unavailable=_broker_away_is_503,
    )
    return router


def _letter_view(letter: DeadLetter) -> dict[str, Any]:
    """A letter as the listing shows it, its time written as every answer writes one."""
    when = letter.dead_lettered_at
    return {**asdict(letter), "dead_lettered_at": None if when is None else rfc3339(when)}


def _unseen(walk: Walk) -> str:
    if walk.truncated:
        return f" among the first {len(walk.letters)} (the queue holds more)"
    return f" ({OUT_OF_SIGHT})"


@contextlib.contextmanager
def _broker_away_is_503() -> Iterator[None]:
    """The broker (or, for a replay, the database) away, blocked or refusing: a 503 to retry,
    not a 500. A replay raises it only before it handled any letter (a failure after that
    ends it with what it did, `interrupted`)."""
    try:
        yield
    except (*BROKER_ERRORS, Unavailable) as error:
        if refused_for_good(error):
            raise database_refused(error) from error
        raise Problem(
            503,
            unavailable_detail(error),
            kind="unavailable",  # as every other 503 of a dependency away
            headers={"Retry-After": "5"},
        ) from error
