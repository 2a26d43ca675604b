"""The AsyncAPI document covers every message and matches the committed copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shared.asyncapi import build_document, message_contracts, topic_matches
from shared.contracts import ModelCallsPaused, TaskCompleted
from shared.topology import EVENTS, TASKS, WORK_QUEUES

COMMITTED = Path(__file__).parents[2] / "docs" / "asyncapi.json"


@pytest.mark.parametrize(
    ("pattern", "key", "matches"),
    [
        ("task.*", "task.completed", True),
        ("task.*", "task.completed.late", False),
        ("*.score.requested", "5s.score.requested", True),
        ("*.score.requested", "score.requested", False),
        ("1s.#", "1s.score.requested", True),
        ("#", "anything.at.all", True),
        ("score.requested", "score.requested", True),
    ],
)
def test_topic_matching(pattern: str, key: str, matches: bool) -> None:
    assert topic_matches(pattern, key) is matches


def test_every_message_contract_has_a_channel_and_a_schema() -> None:
    document = build_document()
    schemas = document["components"]["schemas"]
    channel_keys = {name.split(":", 1)[1] for name in document["channels"]}
    for contract in message_contracts():
        assert contract.__name__ in schemas, contract
        assert contract.routing_key in channel_keys, contract  # type: ignore[attr-defined]


def test_committed_document_is_current() -> None:
    committed = json.loads(COMMITTED.read_text(encoding="utf-8"))
    regenerate = ".venv/bin/python -m shared.asyncapi > docs/asyncapi.json"
    assert committed == json.loads(json.dumps(build_document())), f"stale: run `{regenerate}`"


def test_the_queues_of_single_replicas_are_named_among_a_messages_consumers() -> None:
    """A rate-limit pause reaches every scorer on its own queue, and task events each
    gateway's live queue: the document says so, not only the ops log's or work queues."""
    channels = build_document()["channels"]
    descriptions = {
        name.split(":", 1)[1]: channel.get("description", "") for name, channel in channels.items()
    }
    assert "scorebox.scorer-pauses.<replica>" in descriptions[ModelCallsPaused.routing_key]
    assert "scorebox.ops-log" in descriptions[ModelCallsPaused.routing_key]
    assert "scorebox.live.<replica>" in descriptions[TaskCompleted.routing_key]


def test_every_routing_key_a_work_queue_binds_by_name_has_a_channel() -> None:
    """A key a queue is bound to by name is published by someone: `score.resubmitted` and
    `usage.retry` were missing, each contract named under its own key alone (review)."""
    channel_keys = {name.split(":", 1)[1].split(" ", 1)[0] for name in build_document()["channels"]}
    by_name = {
        binding.routing_key
        for queue in WORK_QUEUES
        for binding in queue.bindings
        if binding.exchange.name in (TASKS.name, EVENTS.name)
        and not {"*", "#"} & set(binding.routing_key.split("."))
    }
    assert by_name
    assert by_name <= channel_keys, by_name - channel_keys
