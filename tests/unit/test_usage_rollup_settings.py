"""`USAGE_ROLLUP_BATCH`: the usage records one slice of the usage rollup takes."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from services.scheduler.settings import SchedulerSettings


def test_the_rollup_batch_defaults_to_20000_and_is_taken() -> None:
    assert SchedulerSettings.model_validate({}).usage_rollup_batch == 20_000
    taken = SchedulerSettings.model_validate({"USAGE_ROLLUP_BATCH": "500"})
    assert taken.usage_rollup_batch == 500
    assert SchedulerSettings.model_validate({"USAGE_ROLLUP_BATCH": "1"}).usage_rollup_batch == 1
    largest = SchedulerSettings.model_validate({"USAGE_ROLLUP_BATCH": "100000"})
    assert largest.usage_rollup_batch == 100_000


@pytest.mark.parametrize("batch", ["0", "-5", "1.5", "100001", "lots", ""])
def test_a_rollup_batch_out_of_range_is_refused(batch: str) -> None:
    """None at all never progresses; past 100,000 the slice's `_id`s no longer fit one
    command safely."""
    with pytest.raises(ValidationError, match="USAGE_ROLLUP_BATCH"):
        SchedulerSettings.model_validate({"USAGE_ROLLUP_BATCH": batch})
