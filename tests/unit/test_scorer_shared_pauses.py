"""Rate-limit pauses shared by the scorer replicas (`services/scorer/shared_pauses.py`): what a
replica announces, and what it makes of another's announcement."""

from __future__ import annotations

import asyncio
import hashlib
from datetime import timedelta

import pytest

from services.scorer.model.settings import ModelSettings
from services.scorer.shared_pauses import PauseAnnouncer, peer_pause_left_s, provider_of
from shared.contracts import ModelCallsPaused, new_id, utcnow
from tests.support import eventually, loop_turns

PROVIDER = "https://llm.example/v1 key:0123456789ab"


def _settings(**values: str) -> ModelSettings:
    env = {
        "LLM_PROVIDER": "openai",
        "LLM_BASE_URL": "https://llm.example/v1",
        "LLM_API_KEY": "sk-one",
    }
    return ModelSettings.model_validate(env | values)


def test_the_provider_is_its_url_and_a_fingerprint_of_the_key_never_the_key() -> None:
    one = provider_of(_settings())
    assert one.startswith("https://llm.example/v1 key:")
    assert "sk-one" not in one
    assert provider_of(_settings(LLM_BASE_URL="https://llm.example/v1/")) == one
    assert provider_of(_settings(LLM_API_KEY="sk-two")) != one
    assert provider_of(_settings(LLM_BASE_URL="https://other.example/v1")) != one
    assert provider_of(_settings(LLM_PROVIDER="heuristic")) == "heuristic"


def test_credentials_in_the_url_are_fingerprinted_as_a_key_is_never_shown() -> None:
    """The URL went out whole on the broker, its password in it (a review)."""
    one = provider_of(_settings(LLM_BASE_URL="https://proxy:s3cret@llm.example/v1", LLM_API_KEY=""))
    other = provider_of(
        _settings(LLM_BASE_URL="https://proxy:other@llm.example/v1", LLM_API_KEY="")
    )
    assert one.startswith("https://llm.example/v1 key:")
    assert "s3cret" not in one
    assert "proxy" not in one
    assert one != other
    keyless = provider_of(_settings(LLM_API_KEY=""))
    assert keyless == "https://llm.example/v1 key:" + hashlib.sha256(b"").hexdigest()[:12]
    with_query = provider_of(_settings(LLM_BASE_URL="https://llm.example/v1?subscription-key=k1"))
    assert with_query.startswith("https://llm.example/v1 key:")
    assert "k1" not in with_query
    assert with_query != provider_of(
        _settings(LLM_BASE_URL="https://llm.example/v1?subscription-key=k2")
    )


@pytest.mark.parametrize(
    "url", ["https://LiteLLM.internal/v1", "https://llm.example:443/v1", "http://h/my models/v1"]
)
def test_a_plain_url_is_named_as_earlier_builds_name_it(url: str) -> None:
    """Re-written by yarl (host lower-cased, the default port dropped, a space encoded),
    replicas of two builds did not hear each other's pauses through an upgrade (a review)."""
    assert provider_of(_settings(LLM_BASE_URL=url)).startswith(f"{url} key:")


def _event(
    *, replica: str = "b", provider: str = PROVIDER, pause_s: float = 20
) -> ModelCallsPaused:
    return ModelCallsPaused(task_id=new_id(), provider=provider, pause_s=pause_s, replica=replica)


def test_another_replicas_pause_lasts_what_is_left_of_it() -> None:
    event = _event(pause_s=20)
    now = event.occurred_at + timedelta(seconds=5)
    assert peer_pause_left_s(event, replica="a", provider=PROVIDER, now=now) == pytest.approx(15)


def test_a_pause_from_a_clock_ahead_lasts_no_longer_than_it_was() -> None:
    event = _event(pause_s=20)
    now = event.occurred_at - timedelta(seconds=30)
    assert peer_pause_left_s(event, replica="a", provider=PROVIDER, now=now) == pytest.approx(20)


@pytest.mark.parametrize(
    ("event", "seconds_later"),
    [
        (_event(replica="a"), 0),  # its own, heard back
        (_event(provider="https://llm.example/v1 key:ffffffffffff"), 0),  # another API key
        (_event(pause_s=20), 21),  # over
    ],
    ids=["own", "another key", "over"],
)
def test_a_pause_of_its_own_of_another_account_or_over_pauses_nothing(
    event: ModelCallsPaused, seconds_later: float
) -> None:
    now = event.occurred_at + timedelta(seconds=seconds_later)
    assert peer_pause_left_s(event, replica="a", provider=PROVIDER, now=now) == 0


async def test_each_pause_begun_is_published_with_its_provider_and_replica() -> None:
    published: list[ModelCallsPaused] = []

    async def publish(event: ModelCallsPaused) -> None:
        published.append(event)

    # Dated by the scorer's clock (the database's), which its peers read its age on: dated
    # by the wall clock, a pause from a replica whose clock was behind read as over (a re-read).
    kept = utcnow() - timedelta(minutes=5)
    announcer = PauseAnnouncer(
        clock=lambda: kept, publish=publish, replica="a", provider=PROVIDER, timeout_s=5
    )
    announcer.announce(12.5)
    announcer.announce(0)  # nothing to tell
    await eventually(lambda: _true(bool(published)), what="the announcement")
    await announcer.close()
    assert [(e.replica, e.provider, e.pause_s) for e in published] == [("a", PROVIDER, 12.5)]
    assert published[0].occurred_at == kept


async def test_an_announcement_that_fails_or_hangs_raises_nothing_and_stops_with_the_scorer(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hanging = asyncio.Event()

    async def refused(_: ModelCallsPaused) -> None:
        raise ConnectionError("broker away")

    async def hangs(_: ModelCallsPaused) -> None:
        await hanging.wait()

    failing = PauseAnnouncer(
        clock=utcnow, publish=refused, replica="a", provider=PROVIDER, timeout_s=5
    )
    failing.announce(3)
    await eventually(lambda: _true("were not told" in caplog.text), what="the failure logged")

    stuck = PauseAnnouncer(
        clock=utcnow, publish=hangs, replica="a", provider=PROVIDER, timeout_s=60
    )
    stuck.announce(3)
    await asyncio.wait_for(stuck.close(), timeout=10)  # cancelled, not awaited to its end


async def test_an_announcement_the_broker_does_not_confirm_in_time_is_given_up(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def never(_: ModelCallsPaused) -> None:
        await asyncio.Event().wait()

    announcer = PauseAnnouncer(
        clock=utcnow, publish=never, replica="a", provider=PROVIDER, timeout_s=0.05
    )
    announcer.announce(3)
    await eventually(lambda: _true("TimeoutError" in caplog.text), what="the timeout logged")


async def _true(value: bool) -> bool:
    return value


async def test_no_announcement_is_made_once_the_scorer_stops() -> None:
    published: list[ModelCallsPaused] = []

    async def publish(event: ModelCallsPaused) -> None:
        published.append(event)

    announcer = PauseAnnouncer(
        clock=utcnow, publish=publish, replica="a", provider=PROVIDER, timeout_s=5
    )
    await announcer.close()
    announcer.announce(10)  # a call still finishing in its slot met a 429
    await loop_turns()  # an announcement made would be published by now
    assert published == []
