"""Dead letters of the webhook queue moved back to it: which deliveries are such letters, and
the fresh round of attempts one gets (`tests/integration/test_notifier_moved_back_letters.py`
runs them on the real broker and database)."""

from __future__ import annotations

from typing import Any

import pytest

from services.notifier.consumer import is_moved_back_letter
from services.notifier.deliveries import fresh_round
from shared.contracts import DeliverWebhook, WebhookPurpose
from shared.topology import ERROR_HEADER, ROUTING_KEY_HEADER, WEBHOOK_DELIVERIES

Json = dict[str, Any]


def _death(queue: str, reason: str) -> Json:
    return {"queue": queue, "reason": reason, "exchange": "scorebox.tasks", "count": 1}


@pytest.mark.parametrize(
    ("headers", "moved_back"),
    [
        ({}, False),
        ({"x-delivery-count": 3, "x-scorebox-earlier-deliveries": 2}, False),
        # A retry's wait on the ladder: RabbitMQ dead-letters it from the wait queue.
        ({"x-death": [_death("scorebox.wait.5s", "expired")]}, False),
        # A letter of another queue's, published here by mistake, is not one of this one's.
        ({"x-death": [_death("scorebox.score-requests", "delivery_limit")]}, False),
        ({ERROR_HEADER: "gave up after 8 attempt(s)", ROUTING_KEY_HEADER: "webhook.deliver"}, True),
        ({"x-death": [_death(WEBHOOK_DELIVERIES.name, "delivery_limit")]}, True),
        (
            {
                "x-death": [
                    _death(WEBHOOK_DELIVERIES.name, "rejected"),
                    _death("scorebox.wait.1s", "expired"),
                ]
            },
            True,
        ),
    ],
)
def test_a_letter_of_this_queue_is_told_by_its_headers(headers: Json, moved_back: bool) -> None:
    assert is_moved_back_letter(headers) is moved_back


def _command(attempt: int, max_attempts: int) -> DeliverWebhook:
    return DeliverWebhook(
        task_id="t1",
        delivery_id="msg_1",
        purpose=WebhookPurpose.CALLBACK,
        url="https://hooks.example.com/h",
        event_type="task.completed",
        payload={"type": "task.completed"},
        attempt=attempt,
        max_attempts=max_attempts,
        deferrals=3,
    )


@pytest.mark.parametrize(
    ("letter", "round_from", "first", "last"),
    [
        pytest.param((8, 8), 1, 9, 16, id="attempts-spent"),
        pytest.param((3, 8), 1, 4, 11, id="given-up-at-the-delivery-limit"),
        pytest.param((16, 16), 9, 17, 24, id="second-round-spent"),
    ],
)
def test_a_fresh_round_goes_on_from_the_next_attempt_with_the_last_rounds_budget(
    letter: tuple[int, int], round_from: int, first: int, last: int
) -> None:
    given_up = _command(*letter)

    fresh = fresh_round(given_up, round_from=round_from)

    assert (fresh.attempt, fresh.max_attempts) == (first, last)
    assert (fresh.not_before, fresh.deferrals) == (None, 0)
    assert fresh.message_id != given_up.message_id
    renewed = {"attempt", "max_attempts", "not_before", "deferrals", "message_id"}
    assert fresh.model_dump(exclude=renewed) == given_up.model_dump(exclude=renewed)
