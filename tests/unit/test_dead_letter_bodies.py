"""How the admin routes show a dead letter's body (`readable_body`): JSON as JSON, and as text
whatever the answer could not hold (showing a letter of JSON nested about 300 deep was a 500,
orjson reading what the answer's serializer refused)."""

from __future__ import annotations

import pydantic_core
import pytest

from shared.dead_letters import readable_body


def _nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


def test_a_json_body_is_shown_as_json() -> None:
    assert readable_body(b'{"task_id": "t", "text": "An essay."}') == {
        "task_id": "t",
        "text": "An essay.",
    }


def test_a_body_that_is_not_json_is_shown_as_text() -> None:
    assert readable_body(b"not json \xff") == "not json \ufffd"


@pytest.mark.parametrize("depth", [300, 1000])
def test_json_nested_deeper_than_an_answer_holds_is_shown_as_text(depth: int) -> None:
    shown = readable_body(_nested(depth))
    assert shown == _nested(depth).decode()
    pydantic_core.to_json({"body": shown})


def test_json_nested_as_deep_as_an_answer_holds_is_shown_as_json() -> None:
    deepest = next(
        depth for depth in range(400, 0, -1) if not isinstance(readable_body(_nested(depth)), str)
    )
    pydantic_core.to_json({"message_id": "m", "body": readable_body(_nested(deepest))})
    assert deepest > 100
