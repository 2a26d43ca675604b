"""The notifier's admin routes: its webhook deliveries' dead-letter queue
(`/admin/v1/webhooks/dead-letters`), guarded by `ADMIN_API_KEY` as the gateway's and the
scheduler's admin routes are (unset: 403).

    GET    /admin/v1/webhooks/dead-letters            the DLQ, oldest first (not consumed)
    GET    /admin/v1/webhooks/dead-letters/{id}       one letter, with what its webhook POSTs
    POST   /admin/v1/webhooks/dead-letters/replay     {ids: [...]} | {all: true}: each letter
                                                      moved back to its queue, for a fresh
                                                      round of attempts
    DELETE /admin/v1/webhooks/dead-letters/{id}[?dead_lettered_before=<RFC 3339>]
                                                      every copy of one delivery's letter, or
                                                      one letter by message id, sending nothing
    DELETE /admin/v1/webhooks/dead-letters[?dead_lettered_before=<RFC 3339>]
                                                      purge
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict
from typing import Any

from fastapi import APIRouter, Request
from pydantic import BaseModel, ConfigDict, Field, SecretStr

from services.notifier.dead_letters import BROKER_AWAY, WebhookDeadLetters, WebhookWalk
from shared.bodies import json_body, read_model
from shared.bus import BROKER_ERRORS
from shared.contracts import Instant
from shared.dead_letter_routes import add_removal_routes, refuse_a_read_of_the_replay
from shared.dead_letters import (
    CUT_OFF,
    REPLAY_BODY_LIMIT,
    REPLAY_BUDGET_S,
    WALK_BOUND,
    ReplayRequest,
)
from shared.http import ADMIN_PROBLEMS, Problem, admin_guard, problem_responses, quoted

PREFIX = "/admin/v1/webhooks/dead-letters"
# What no walk sees: the letters another walk holds at that moment.
OUT_OF_SIGHT = (
    "a letter another walk holds at that moment is out of sight: a walk of another notifier "
    "replica, or the scheduler's dead-letter depth probe, which takes the head of the queue "
    "for a moment"
)


class _Out(BaseModel):
    model_config = ConfigDict(frozen=True)


class WebhookDeadLetterView(_Out):
    message_id: str
    delivery_id: str | None = Field(
        description="The `webhook-id` the receiver sees, the same for every attempt; null for "
        "an unreadable letter (name it by its message id)."
    )
    task_id: str | None
    tenant_id: str | None
    purpose: str | None = Field(description="`callback` or `failure_alert`.")
    event_type: str | None
    url: str | None = Field(description="The destination, without credentials or query.")
    attempt: int | None = Field(
        description="The attempt given up. Numbered on across rounds: a letter moved back "
        "gets a fresh round of as many attempts as its last round had, from the attempt after "
        "this one."
    )
    max_attempts: int | None = Field(description="The last attempt of its round.")
    reason: str
    queue: str
    dead_lettered_at: Instant | None


class ShownWebhookDeadLetter(WebhookDeadLetterView):
    body: Any = Field(
        description="The JSON the webhook POSTs, as signed and sent; for a letter that holds "
        "no webhook delivery, its whole body (JSON when it parses, else text)."
    )


class WebhookDeadLetterList(_Out):
    count: int
    truncated: bool = Field(description="The walk stopped with letters left behind it.")
    listed_at: Instant = Field(
        description=f"When the listing was taken (before its walk): as `{CUT_OFF}`, a drop or "
        "a purge keeps the letters dead-lettered since."
    )
    items: list[WebhookDeadLetterView] = Field(description="Oldest dead-lettered first.")


class MovedBackView(_Out):
    delivery_id: str
    message_id: str
    attempt: int = Field(description="The attempt the letter had given up.")


class WebhookReplayReport(_Out):
    replayed: list[MovedBackView] = Field(
        description="Letters moved back to the webhook queue, one per letter: each delivery "
        "gets a fresh round of attempts, or nothing more if it was delivered since (copies of "
        "one delivery are POSTed once)."
    )
    skipped_unreadable: list[str] = Field(
        description="Message ids of letters that hold no webhook delivery, kept: drop them."
    )
    not_found: list[str] = Field(
        description="Ids asked for that no letter matched, the walk having reached the end of "
        f"the queue ({OUT_OF_SIGHT})."
    )
    not_reached: list[str] = Field(
        description="Ids asked for that no letter matched before the walk stopped at its bound "
        "(`truncated`): they may name letters past it; and those of letters the replay's "
        "budget or an interruption left in the queue: ask again."
    )
    truncated: bool = Field(
        description=f"The walk stopped at its bound ({WALK_BOUND}) with letters left behind "
        "it: `all` replayed only the letters it reached."
    )
    timed_out: bool = Field(
        description=f"The replay stopped at its {REPLAY_BUDGET_S:.0f} s budget with letters it "
        "had chosen left in the queue: ask again for the rest."
    )
    interrupted: str | None = Field(
        description="Why the replay stopped early, null when it did not: the broker failed "
        "after some letters were moved back (those in `replayed`). A failure before any was "
        "answers 503."
    )


def webhook_dead_letter_routes(
    *, dead_letters: WebhookDeadLetters, admin_key: SecretStr | None
) -> APIRouter:
    router = APIRouter(
        prefix=PREFIX,
        tags=["admin"],
        dependencies=[admin_guard(admin_key)],
        responses={**ADMIN_PROBLEMS, **problem_responses(503)},
    )

    @router.get("", response_model=WebhookDeadLetterList)
    async def list_webhook_dead_letters() -> WebhookDeadLetterList:
        with _broker_away_is_503():
            walk = await dead_letters.letters()
        items = [WebhookDeadLetterView(**asdict(letter)) for letter in walk.letters]
        return WebhookDeadLetterList(
            count=len(items), truncated=walk.truncated, listed_at=walk.listed_at, items=items
        )

    @router.get(
        "/{letter_id}",
        response_model=ShownWebhookDeadLetter,
        summary="One dead letter by delivery or message id, with what its webhook POSTs",
        responses=problem_responses(404, 405),
    )
    async def show_webhook_dead_letter(request: Request, letter_id: str) -> ShownWebhookDeadLetter:
        refuse_a_read_of_the_replay(request, letter_id)
        with _broker_away_is_503():
            found = await dead_letters.shown(letter_id)
        if isinstance(found, WebhookWalk):
            unseen = (
                f" among the first {len(found.letters)} (the queue holds more)"
                if found.truncated
                else f" ({OUT_OF_SIGHT})"
            )
            raise Problem(
                404, f"No dead letter with delivery or message id {quoted(letter_id)}{unseen}."
            )
        return ShownWebhookDeadLetter(**asdict(found.letter), body=found.body)

    @router.post(
        "/replay",
        response_model=WebhookReplayReport,
        openapi_extra=json_body(ReplayRequest),
        responses=problem_responses(400, 413, 415, 422),
    )
    async def replay_webhook_dead_letters(request: Request) -> WebhookReplayReport:
        wanted = await read_model(request, ReplayRequest, what="replay", limit=REPLAY_BODY_LIMIT)
        with _broker_away_is_503():
            replay = await dead_letters.replay(None if wanted.all else wanted.ids)
        return WebhookReplayReport.model_validate(asdict(replay))

    add_removal_routes(
        router,
        dead_letters,
        path="",
        named_by="delivery or message id",
        out_of_sight=OUT_OF_SIGHT,
        unavailable=_broker_away_is_503,
    )
    return router


@contextlib.contextmanager
def _broker_away_is_503() -> Iterator[None]:
    """The broker away, blocked or refusing: a 503 to retry. A replay raises it only before
    it moved any letter back (a failure after that ends it with what it did,
    `interrupted`)."""
    try:
        yield
    except BROKER_ERRORS as error:
        raise Problem(
            503,
            BROKER_AWAY,
            kind="broker-unavailable",
            headers={"Retry-After": "5"},
        ) from error
