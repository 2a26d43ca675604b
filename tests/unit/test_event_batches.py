"""A batch's wire format (`shared.event_batches`): what goes in comes out, byte for byte, and
a header that does not describe its body is refused rather than misread."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pamqp import commands, header
from pamqp.frame import marshal

from services.scorer.settings import ScorerSettings
from shared.batched_publish import batchable
from shared.consumers import BatchPart, _settle_batch
from shared.contracts import ScoreResult, TaskCompleted, TaskError, TaskFailed, new_id, utcnow
from shared.event_batches import (
    BATCH_HEADER,
    OneEvent,
    Part,
    UnreadableBatch,
    encode_batch,
    is_batch,
    split_batch,
)
from tests.support import HandedDelivery

_ids = st.text(alphabet="0123456789abcdef", min_size=1, max_size=32)
_events = st.builds(
    OneEvent,
    body=st.dictionaries(st.text(max_size=8), st.text(max_size=40), max_size=4).map(
        lambda document: json.dumps(document, ensure_ascii=False).encode()
    ),
    message_id=_ids,
    task_id=_ids,
    tenant_id=st.text(min_size=1, max_size=12),
)


@given(st.lists(_events, min_size=1, max_size=20))
def test_every_event_comes_out_of_its_batch_as_it_went_in(events: list[OneEvent]) -> None:
    body, parts = encode_batch(events)
    assert json.loads(body) == [json.loads(event.body) for event in events]  # a JSON array
    headers = {"x-schema-version": 2, "x-tenant-id": "first", BATCH_HEADER: parts}
    split = split_batch(body, headers)
    assert [part.body for part in split] == [event.body for event in events]
    assert [part.message_id for part in split] == [event.message_id for event in events]
    assert [part.correlation_id for part in split] == [event.task_id for event in events]
    for part, event in zip(split, events, strict=True):
        # The batch's headers, less its description, with the part's own tenant.
        assert part.headers == {"x-schema-version": 2, "x-tenant-id": event.tenant_id}


def _batch() -> tuple[bytes, list[list[Any]]]:
    return encode_batch(
        [OneEvent(b'{"a":1}', "m1", "t1", "acme"), OneEvent(b"{}", "m2", "t2", "b")]
    )


@pytest.mark.parametrize(
    ("body", "parts"),
    [
        (b'[{"a":1},{}]', "not a list"),
        (b'[{"a":1},{}]', []),
        (b'[{"a":1},{}]', [[7, "m1", "t1", "acme"]]),  # a part short of the body
        (b'[{"a":1},{}]', [[7, "m1", "t1", "acme"], [3, "m2", "t2", "b"]]),  # past the end
        (b'[{"a":1},{}]', [[6, "m1", "t1", "acme"], [3, "m2", "t2", "b"]]),  # mid-part
        (b'[{"a":1},{}]', [[7, "m1", "t1"], [2, "m2", "t2", "b"]]),  # a field missing
        (b'[{"a":1},{}]', [[7, "m1", "t1", "acme"], [0, "m2", "t2", "b"]]),
        (b'[{"a":1},{}]', [[7, "m1", 3, "acme"], [2, "m2", "t2", "b"]]),
        (b'{"a":1},{}]', [[7, "m1", "t1", "acme"], [2, "m2", "t2", "b"]]),  # no bracket
        (b'[{"a":1},{}] ', [[7, "m1", "t1", "acme"], [2, "m2", "t2", "b"]]),  # trailing
        (b'[{"a":1},{}]', [[True, "m1", "t1", "acme"], [2, "m2", "t2", "b"]]),
        # A wrong length that lands on a comma inside a string: it would cut an event in two.
        (b'[{"a":","},{}]', [[6, "m1", "t1", "acme"], [5, "m2", "t2", "b"]]),
    ],
)
def test_a_header_that_does_not_describe_its_body_is_refused(body: bytes, parts: Any) -> None:
    assert split_batch(*_unchanged()) is not None  # the same shape, well described, reads
    with pytest.raises(UnreadableBatch):
        split_batch(body, {BATCH_HEADER: parts})


def _unchanged() -> tuple[bytes, dict[str, Any]]:
    body, parts = _batch()
    assert body == b'[{"a":1},{}]'
    assert parts == [[7, "m1", "t1", "acme"], [2, "m2", "t2", "b"]]
    return body, {BATCH_HEADER: parts}


def test_a_batch_is_told_by_its_header() -> None:
    assert is_batch({BATCH_HEADER: []})
    assert not is_batch({"x-tenant-id": "acme"})
    assert not is_batch(None)


def _completed(*, callback: str | None) -> TaskCompleted:
    now = utcnow()
    return TaskCompleted(
        task_id=new_id(),
        sequence=90,
        submitted_at=now,
        result=ScoreResult(score=5, comment="ok", model="m"),
        has_callback=callback is not None,
        callback_url=callback,
    )


def test_only_completions_without_a_callback_are_batched() -> None:
    assert batchable(_completed(callback=None))
    assert not batchable(_completed(callback="https://example.com/hook"))
    unsaid = _completed(callback=None).model_copy(update={"has_callback": None})
    assert not batchable(unsaid)  # an older producer's: the notifier looks its task up
    now = utcnow()
    failed = TaskFailed(
        task_id=new_id(),
        sequence=90,
        submitted_at=now,
        error=TaskError(code="x", message="y", retryable=False),
        dead_lettered=False,
    )
    assert not batchable(failed)


async def _settle(how: list[str | None]) -> list[str]:
    """How a batch whose parts were settled `how` is settled (None: left unsettled)."""
    parts = []
    for index, settling in enumerate(how):
        part = BatchPart(cast("Any", None), cast("Any", None), Part(b"{}", f"m{index}", "t", {}))
        match settling:
            case "ack":
                await part.ack()
            case "requeue_failed":
                await part.requeue_failed()
            case "nack-requeue":
                await part.nack(requeue=True)
            case "reject":
                await part.reject(requeue=False)
            case "nack":
                await part.nack(requeue=False)
        parts.append(part)
    batch = HandedDelivery(b"[]")
    await _settle_batch(batch, parts)
    return batch.settled


@pytest.mark.parametrize(
    ("how", "batch"),
    [
        (["ack", "ack"], ["ack"]),
        (["ack", "requeue_failed"], ["reject(requeue=True)"]),
        (["ack", "nack-requeue"], ["reject(requeue=True)"]),  # counted, whichever
        (["ack", "reject"], ["reject(requeue=False)"]),
        (["nack", "ack"], ["reject(requeue=False)"]),
        (["reject", "requeue_failed"], ["reject(requeue=True)"]),  # returned before lost
        (["requeue_failed", None], []),  # unsettled: for the broker to redeliver
        (["reject", None], []),
    ],
)
async def test_a_batch_is_settled_as_its_strictest_part_asks(
    how: list[str | None], batch: list[str]
) -> None:
    assert await _settle(how) == batch


def test_the_largest_batch_a_scorer_may_send_has_its_header_in_one_frame() -> None:
    """AMQP carries a message's content header in one frame, 128 KiB on RabbitMQ by default:
    past it the broker closes the scorer's publishing connection (`frame_too_large`), every
    publish in flight failing with it. So `SCORER_OUTCOME_BATCH_MAX` stops where the longest
    tenant ids (64 characters) still fit."""
    largest = _maximum(ScorerSettings, "outcome_batch_max")
    events = [OneEvent(b"{}", new_id(), new_id(), "t" * 64) for _ in range(largest)]
    _, parts = encode_batch(events)
    headers: dict[str, Any] = {BATCH_HEADER: parts, "x-schema-version": 2}
    properties = commands.Basic.Properties(
        headers=headers, message_id=new_id(), content_type="application/json", delivery_mode=2
    )
    frame = marshal(header.ContentHeader(0, 1, properties), 1)
    assert len(frame) <= RABBITMQ_FRAME_MAX


RABBITMQ_FRAME_MAX = 131_072


def _maximum(settings: Any, name: str) -> int:
    [bound] = [m.le for m in settings.model_fields[name].metadata if getattr(m, "le", None)]
    return int(bound)
