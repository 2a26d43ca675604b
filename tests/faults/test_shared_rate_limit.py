"""A provider's rate limit met by one of two scorer processes pauses the other as well, before
it spends calls of its own on the limit (`services/scorer/shared_pauses.py`).

The fake model answers every call 429 with `Retry-After` for a while. One task goes first:
the scorer that takes it is refused, pauses, and tells the other, which pauses on its word
(its `scorebox_model_rate_limit_pauses_shared_total`). The rest are submitted during the
pause; each scorer then spends one probe per pause until the limit ends, and every task
completes, none scored twice.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import httpx
import pytest

from devtools.fake_llm import FakeLLM
from tests.faults.harness import (
    HTTP_TIMEOUT_S,
    BoxParts,
    Figures,
    Outcome,
    Scorebox,
    essay,
    new_marker,
    running_scorebox,
)
from tests.support import eventually, metric_sum

SCORERS = 2
RETRY_AFTER_S = 5  # within RATE_LIMIT_HOLD_S (30): the deliveries wait in hand
RATE_LIMIT_WINDOW_S = 12.0
TASKS = 12


@pytest.fixture(scope="module")
async def box(box_parts: BoxParts) -> AsyncIterator[Scorebox]:
    async with running_scorebox(box_parts, scorer_replicas=SCORERS) as running:
        yield running


async def _paused_on_the_others_word(box: Scorebox) -> bool:
    """A pause of one scorer paused the other (counted over both)."""
    heard = 0.0
    async with httpx.AsyncClient(timeout=HTTP_TIMEOUT_S) as client:
        for replica in range(SCORERS):
            answer = await client.get(
                f"{box.stack.url('scorer', replica)}/metrics",
                headers=box.stack.metrics_headers(),
            )
            assert answer.status_code == 200, answer.text
            heard += metric_sum(answer.text, "scorebox_model_rate_limit_pauses_shared_total")
    return heard > 0


def _rate_limited(llm: FakeLLM) -> int:
    return int(llm.stats()["status_counts"].get("429", 0))


async def test_a_rate_limit_met_by_one_scorer_pauses_the_other_before_its_own_calls(
    box: Scorebox, llm: FakeLLM, figures: Figures, labels: tuple[str, str]
) -> None:
    before = _rate_limited(llm)
    llm.config.rate_limit_retry_s = RETRY_AFTER_S
    llm.config.rate_limited_until = time.monotonic() + RATE_LIMIT_WINDOW_S
    try:
        markers = [new_marker() for _ in range(TASKS)]
        first = await box.submit(essay(markers[0]))
        await eventually(lambda: _paused_on_the_others_word(box), what="the other paused")
        # The scorer that took the first task was refused once; the other called nothing.
        assert _rate_limited(llm) - before == 1
        rest = [await box.submit(essay(marker)) for marker in markers[1:]]
        views = await box.finish([first, *rest])
    finally:
        llm.config.rate_limited_until = 0.0
        llm.config.rate_limit_retry_s = 0.0
    statuses = [view["status"] for view in views.values()]
    limited = _rate_limited(llm) - before
    scored_twice = sum(max(0, box.calls(marker) - 1) for marker in markers)
    figures.record(
        Outcome(
            name=(
                f"provider rate limit met by one of {SCORERS} scorers (every call 429 for "
                f"{RATE_LIMIT_WINDOW_S:g} s, Retry-After {RETRY_AFTER_S} s)"
            ),
            accepted=len(views),
            completed=statuses.count("completed"),
            failed=statuses.count("failed"),
            duplicate_model_calls=scored_twice,
            http_5xx_seen=box.http_5xx(),
            time_to_recover_s=None,
            broker=labels[0],
            database=labels[1],
            notes=(
                f"{limited} calls answered 429 for {len(views)} tasks: the first scorer's "
                "pause paused the other before it called, then one probe per scorer per pause"
            ),
        )
    )
    assert statuses == ["completed"] * TASKS, [view.get("error") for view in views.values()]
    assert scored_twice == 0
