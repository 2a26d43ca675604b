"""Topology: the wait ladder and the queue arguments both RabbitMQ 3.x and 4.x depend on."""

from __future__ import annotations

import pytest

from shared.contracts import ScoreText
from shared.topology import (
    DLX,
    EVENTS,
    RESCORES_WAIT,
    RESCORES_WAIT_TIER,
    SCORE_REQUESTS,
    STATUS_PROJECTION,
    TASKS,
    USAGE_METER,
    WAIT_QUEUE_TIERS,
    WAIT_TIERS,
    WORK_QUEUES,
    WorkQueue,
    delay_routing_key,
    wait_queue,
    wait_tier_for,
)


@pytest.mark.parametrize(
    ("delay_s", "tier"),
    [
        (0.0, None),
        (0.49, None),
        (0.5, "1s"),
        (1.0, "1s"),
        (4.4, "1s"),
        (4.99999, "5s"),  # "5 s from now", read a moment later: it took the 1 s tier
        (5.0, "5s"),
        (29.0, "5s"),
        (29.6, "30s"),
        (45.0, "30s"),
        (119.0, "30s"),
        (120.0, "2m"),
        (599.0, "2m"),
        (3599.0, "10m"),
        (3600.0, "1h"),
        (7 * 24 * 3600.0, "1h"),
    ],
)
def test_a_delay_waits_in_the_largest_tier_not_longer_than_it(
    delay_s: float, tier: str | None
) -> None:
    chosen = wait_tier_for(delay_s)
    assert (chosen[0] if chosen else None) == tier


def test_hops_down_the_ladder_never_overshoot_by_more_than_a_second() -> None:
    for delay in (0.7, 3.2, 61.0, 3_725.5, 86_400.0):
        remaining, waited = delay, 0.0
        while (tier := wait_tier_for(remaining)) is not None:
            waited += tier[1]
            remaining = delay - waited
        assert -1.0 < delay - waited < 0.5


def test_every_work_queue_is_quorum_with_limit_and_at_least_once_dead_lettering() -> None:
    for work_queue in WORK_QUEUES:
        arguments = work_queue.queue.arguments
        assert arguments["x-queue-type"] == "quorum"
        assert arguments["x-delivery-limit"] >= 1
        assert arguments["x-dead-letter-exchange"] == DLX.name
        assert arguments["x-dead-letter-strategy"] == "at-least-once"
        assert arguments["x-overflow"] == "reject-publish"
        assert work_queue.dead_letter_queue.name == f"{work_queue.name}.dlq"


def test_wait_queues_dead_letter_back_to_the_due_exchange() -> None:
    for tier, seconds in WAIT_QUEUE_TIERS:
        assert "." not in tier  # one word of a topic key: `*.<target key>` in `scorebox.due`
        arguments = wait_queue(tier, seconds).arguments
        assert arguments["x-message-ttl"] == seconds * 1000
        assert arguments["x-dead-letter-exchange"] == "scorebox.due"
    assert delay_routing_key("5s", "score.requested") == "5s.score.requested"
    due_binding = [
        b.routing_key for b in SCORE_REQUESTS.bindings if b.exchange.name == "scorebox.due"
    ]
    assert due_binding == ["*.score.requested"]


def test_the_re_score_requests_wait_queue_is_chosen_for_no_delay() -> None:
    """It is counted by the re-score fan-out as re-score requests alone."""
    assert wait_queue(*RESCORES_WAIT_TIER).name == RESCORES_WAIT
    assert RESCORES_WAIT_TIER not in WAIT_TIERS
    delays = [seconds + offset for _, seconds in WAIT_QUEUE_TIERS for offset in (-0.4, 0, 1)]
    assert all(wait_tier_for(delay) in (*WAIT_TIERS, None) for delay in delays)


def _keys(queue: WorkQueue) -> set[tuple[str, str]]:
    return {(binding.exchange.name, binding.routing_key) for binding in queue.bindings}


def test_a_task_sent_again_reaches_the_scorer_and_not_the_projection() -> None:
    """The projection learns of a resubmission from its announcement, once the broker took
    it: a copy of a command the full score queue refused showed a generation that never ran."""
    resubmitted = (TASKS.name, ScoreText.resubmission_routing_key)
    assert resubmitted in _keys(SCORE_REQUESTS)
    assert resubmitted not in _keys(STATUS_PROJECTION)
    assert (TASKS.name, ScoreText.routing_key) in _keys(STATUS_PROJECTION)


def test_the_usage_meter_hears_completions_and_failures() -> None:
    assert {(EVENTS.name, "task.completed"), (EVENTS.name, "task.failed")} <= _keys(USAGE_METER)
