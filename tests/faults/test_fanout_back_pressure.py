"""A full re-score queue is back-pressure to the scheduler's fan-out, not a failure.

The queue is made full with a policy in this module's vhost (nothing consumes it here). The
fan-out's page publish names the refusal `DownstreamFull`, which its run waits out instead of
counting it as a failed attempt (`services/scheduler/runs.py`, tested in
`tests/unit/test_scheduler_dispatch.py`): counted, a big fan-out was given up within a minute
of the queue filling.
"""

from __future__ import annotations

import pytest

from services.scheduler.errors import DownstreamFull
from services.scheduler.messaging import SchedulerBus
from services.scheduler.settings import SchedulerSettings
from shared.contracts import ScoreText, new_id, utcnow
from shared.runtime import make_broker
from shared.topology import RESCORE_REQUESTS, declare_topology
from tests.faults.harness import queue_made_full, rabbitmqctl_available
from tests.support import rescore_request

POLICY = "scorebox-test-rescore-queue-full"
TIMEOUT_S = 30.0


async def test_a_full_rescore_queue_refuses_a_page_as_downstream_full(amqp_url: str) -> None:
    if not rabbitmqctl_available(amqp_url):
        pytest.skip("needs rabbitmqctl for a broker on this machine")
    broker = make_broker(SchedulerSettings.model_validate({"RABBITMQ_URL": amqp_url}))
    page = [rescore_request(ScoreText(task_id=new_id(), text="Again.")) for _ in range(3)]
    async with broker:
        await broker.connect()
        await declare_topology(broker)
        bus = SchedulerBus(broker, timeout_s=TIMEOUT_S, clock=utcnow)
        async with queue_made_full(
            amqp_url, RESCORE_REQUESTS.name, policy=POLICY, timeout_s=TIMEOUT_S
        ):
            with pytest.raises(DownstreamFull):
                await bus.publish_rescore_page(page)
        await bus.publish_rescore_page(page)  # room again
