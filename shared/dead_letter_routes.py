"""The routes that remove dead letters, alike on every service that owns a DLQ whose letters
are named by one id (the gateway's score requests, the notifier's webhooks): drop one letter
(every copy), and purge; and what their show routes refuse alike."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

from fastapi import APIRouter, Request

from shared.bodies import refuse_a_body
from shared.dead_letters import (
    NOTHING_REMOVED,
    CutOff,
    CutOffQuery,
    Dropped,
    DropReport,
    Purgeable,
    PurgeReport,
    nothing_dropped,
    purge_report,
)
from shared.http import Problem, problem, problem_responses, quoted

# The replay route's last segment, which the show route's `{letter_id}` also fits.
REPLAY_SEGMENT = "replay"


def refuse_a_read_of_the_replay(request: Request, letter_id: str) -> None:
    """A 405 for `GET .../dead-letters/replay`: the show route took it for a letter named
    `replay`, walked the queue for it and answered 404, as if the replay route were not
    there (a review)."""
    if letter_id == REPLAY_SEGMENT:
        raise Problem(
            405,
            f"{request.method} is not allowed on {request.url.path}; it takes POST.",
            headers={"Allow": "POST"},
        )


class Removable(Purgeable, Protocol):
    async def drop(self, letter_id: str, *, cut_off: CutOff | None = None) -> Dropped: ...


def add_removal_routes(
    router: APIRouter,
    dead_letters: Removable,
    *,
    path: str,
    named_by: str,
    out_of_sight: str,
    unavailable: Callable[[], AbstractContextManager[None]],
) -> None:
    """`DELETE {path}/{letter_id}` and `DELETE {path}` on `router`. `named_by` says what a
    letter id is (`message or task id`); `out_of_sight`, which letters no walk sees at a
    moment; `unavailable`, how a dependency away is answered (a 503)."""
    drop_problems: dict[int | str, dict[str, Any]] = {
        404: problem(
            404,
            f"No letter has that {named_by}, the walk having reached the end of the queue; "
            f"nothing was removed ({out_of_sight}; ask again to be sure).",
        ),
        409: problem(
            409,
            f"No letter with that {named_by} among those the walk reached before its bound "
            "or its time budget (`not-reached`): it may lie past it. Nothing was removed.",
        ),
    }

    @router.delete(
        f"{path}/{{letter_id}}",
        summary=f"Drop one dead letter (every copy of it) by {named_by}",
        response_model=DropReport,
        response_model_exclude_none=True,
        responses={**drop_problems, **problem_responses(422)},
    )
    async def drop_dead_letter(
        letter_id: str, cut_off: CutOffQuery, request: Request
    ) -> DropReport:
        await refuse_a_body(request, outcome=NOTHING_REMOVED)
        with unavailable():
            dropped = await dead_letters.drop(letter_id, cut_off=cut_off)
        if not dropped.removed and not dropped.kept:
            raise nothing_dropped(
                f"No dead letter with {named_by} {quoted(letter_id)}",
                dropped,
                out_of_sight=out_of_sight,
            )
        return DropReport.of(letter_id, dropped, cut_off)

    @router.delete(
        path,
        summary="Purge the dead-letter queue (with a cut-off: the letters dead-lettered before it)",
        response_model=PurgeReport,
        response_model_exclude_none=True,
        responses=problem_responses(422),
    )
    async def purge_dead_letters(cut_off: CutOffQuery, request: Request) -> PurgeReport:
        await refuse_a_body(request, outcome=NOTHING_REMOVED)
        with unavailable():
            return await purge_report(dead_letters, cut_off)
