"""Guards of the batch code that no other test held (each could be broken with every test
passing): what a batch cancel counts and sends for items whose submissions are gone or written
off, whose row a batch read shows on an item, and which batch records the outbox sweep's
`outlive_sends` touches.

The cancels run through the gateway in-process against the real broker and database
(`test_gateway_batch_cancel`'s stack); the others on the gateway's records alone
(`test_batch_expiry`'s records, clock passed in, expiries ahead of the wall clock)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from services.gateway.batches import HOLD_CHECK_AT, read_batch
from services.gateway.submissions import TOMBSTONE_TTL, Submissions, SubmissionState
from services.gateway.submit import CHUNK_ALLOWANCE
from shared.contracts import new_id, utcnow
from tests.integration import test_batch_expiry as expiry
from tests.integration import test_gateway_cancel as single
from tests.integration.gateway_records import GatewayRecords as Gateway
from tests.integration.test_batch_expiry import RETENTION, _batch, _hold, _now, _stored
from tests.integration.test_batch_unsent_reads import WINDOW, Heard
from tests.integration.test_gateway_batch_cancel import _batch as _sent_batch
from tests.integration.test_gateway_cancel import Stack, _sent_cancels

pytestmark = pytest.mark.integration

stack = single.stack  # the fixtures
gateway = expiry.gateway


async def test_an_item_whose_submission_expired_counts_as_neither_cancelling_nor_finished(
    stack: Stack,
) -> None:
    """Broke before: `already_finished` counted the batch's members less the cancels sent
    (`len(record.members) - len(cancels)`), so an item whose submission had expired was
    reported as already finished."""
    batch_id, (first, expired, last) = await _sent_batch(stack, size=3)
    await stack.submissions.delete_one({"_id": expired})  # its TTL index's doing
    await _sent_cancels(stack.amqp_url)

    response = await stack.api.post(f"/v1/batches/{batch_id}/cancel")

    assert response.status_code == 202, response.text
    answer = response.json()
    assert answer["cancelling"] + answer["already_finished"] == 3 - 1
    assert (answer["cancelling"], answer["already_finished"]) == (2, 0)
    assert {cancel.task_id for cancel in await _sent_cancels(stack.amqp_url)} == {first, last}


async def test_a_written_off_item_is_neither_sent_a_cancel_nor_counted(stack: Stack) -> None:
    """Broke before: without `cancel_targets`' `"state": {"$ne": abandoned}`, a batch
    cancel read the tombstone of an item refused after all, sent it a `CancelTask` and
    counted it as cancelling."""
    batch_id, (kept, refused) = await _sent_batch(stack, size=2)
    # The item's request never marked it sent, and its refusal wrote it off (a tombstone,
    # which keeps its batch and tenant) while the batch's record stands.
    await stack.submissions.update_one(
        {"_id": refused}, {"$set": {"state": SubmissionState.ACCEPTING.value}}
    )
    submissions = Submissions(stack.mongo, f"{stack.db_prefix}_gateway")
    await submissions.abandon((refused,), now=utcnow())
    tombstone = await stack.submissions.find_one({"_id": refused})
    assert tombstone["state"] == SubmissionState.ABANDONED.value
    assert tombstone["batch_id"] == batch_id
    await _sent_cancels(stack.amqp_url)

    response = await stack.api.post(f"/v1/batches/{batch_id}/cancel")

    assert response.status_code == 202, response.text
    answer = response.json()
    assert (answer["cancelling"], answer["already_finished"]) == (1, 0)
    assert [cancel.task_id for cancel in await _sent_cancels(stack.amqp_url)] == [kept]


async def test_a_row_at_an_items_index_for_another_task_is_not_shown_on_the_item(
    gateway: Gateway,
) -> None:
    """Broke before: with `_heard` reduced to `progress is not None`, the status service's
    row at an item's batch index was shown on the item whatever task it was of: another
    task's status and result read as the item's."""
    now = _now()
    batch_id, task_ids = await _batch(gateway, created_at=now, items=3)
    other = Heard(new_id())  # a completed row at index 1, of a task not in the batch

    page = await read_batch(
        batch_id,
        tenant_id="default",
        start=0,
        limit=10,
        batches=gateway.batches,
        status=other,
        submissions=gateway.submissions,
        clock=lambda: now,
        window=WINDOW,
        grace=timedelta(seconds=30),
    )

    assert page is not None
    item = page.items[1]
    assert item.task_id == task_ids[1]
    assert item.task_id != other.item.task_id
    assert (item.status, item.result, item.attempts) == ("queued", None, 0)
    assert [entry.status for entry in page.items] == ["queued"] * 3


async def test_the_sweep_leaves_a_written_off_batch_record_alone(gateway: Gateway) -> None:
    """Broke before: without `outlive_sends`' state filter, a chunk of the sweep naming a
    batch written off meanwhile gave its tombstone a longer expiry and a look
    (`hold_check_at`); a tombstone upserted by a refusal whose batch insert never landed has
    no `tenant_id` nor `request_hash`, and the hold pass then failed on it (`KeyError` in
    `_record_of`) at every run."""
    now = _now()
    batch_id = new_id()
    assert await gateway.batches.abandon(batch_id, now=now)  # its insert never landed
    tombstone = await _stored(gateway, batch_id)
    assert "tenant_id" not in tombstone

    await gateway.batches.outlive_sends(
        [batch_id], sent_at=now + CHUNK_ALLOWANCE, retention=RETENTION
    )

    left = await _stored(gateway, batch_id)
    assert HOLD_CHECK_AT not in left
    assert left["expires_at"] == now + TOMBSTONE_TTL
    assert left["state"] == SubmissionState.ABANDONED.value
    # The look it would have had comes and goes: nothing held, nothing raised.
    assert await _hold(gateway, now + CHUNK_ALLOWANCE + RETENTION) == 0
    assert HOLD_CHECK_AT not in await _stored(gateway, batch_id)


async def test_a_batch_whose_items_the_sweep_sends_outlives_a_refusal_still_running(
    gateway: Gateway,
) -> None:
    """Broke before (found in review): a refusal that outlasted the outbox grace (its slots
    released one round trip each) found its batch `accepting` after another replica's sweep
    had sent every item, deleted the record (`discard`) and answered 503 "nothing was kept":
    the tasks were scored, the batch read 404, and a replay with the key, free again,
    scored every text twice. The sweep's `outlive_sends` now marks the batch, which neither
    `discard` nor the write-off's `abandon` removes; it stays `accepting`, for a replay to
    complete. A batch the sweep never touched is still discarded."""
    now = _now()
    swept, _ = await _batch(gateway, created_at=now, items=2, key="swept")
    untouched, _ = await _batch(gateway, created_at=now, items=2, key="untouched")

    await gateway.batches.outlive_sends([swept], sent_at=now + CHUNK_ALLOWANCE, retention=RETENTION)

    assert not await gateway.batches.discard(swept)
    assert not await gateway.batches.abandon(swept, now=now)
    kept = await _stored(gateway, swept)
    assert (kept["state"], kept["idempotency_key"]) == ("accepting", "swept")
    assert await gateway.batches.discard(untouched)
