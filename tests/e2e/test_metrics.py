"""`GET /metrics` of every service, as Prometheus scrapes it, while tasks go through them."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import httpx
from prometheus_client.parser import text_string_to_metric_families

from devtools.stack import Stack
from tests.e2e.conftest import ADMIN_KEY, METRICS_KEY
from tests.support_sync import wait_for

SERVICES = ("gateway", "scorer", "status", "scheduler", "notifier")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(stack: Stack, service: str) -> Samples:
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"} if service == "gateway" else {}
    answer = httpx.get(f"{stack.url(service)}/metrics", headers=headers, timeout=10)
    assert answer.status_code == 200, (service, answer.text)
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(answer.text)
        for sample in family.samples
    }


def total(samples: Samples, name: str, **labels: str) -> float:
    """The sum of `name` over the series whose labels include `labels`."""
    wanted = set(labels.items())
    return sum(value for (each, got), value in samples.items() if each == name and wanted <= got)


@dataclass(frozen=True)
class Growth:
    """What a service's counters gained between two scrapes."""

    before: Samples
    after: Samples

    def of(self, name: str, **labels: str) -> float:
        return total(self.after, name, **labels) - total(self.before, name, **labels)


def test_every_service_counts_what_a_scored_task_took_through_it(
    stack: Stack, api_key: str
) -> None:
    before = {service: scrape(stack, service) for service in SERVICES}
    texts = [
        f"Metrics essay: counters tell operators what happened. [[id:{uuid.uuid4().hex}]]",
        f"Metrics essay: rate limits are retried. [[id:{uuid.uuid4().hex}]] [[fake:429x1:retry=1]]",
    ]
    auth = {"Authorization": f"Bearer {api_key}"}
    with httpx.Client(base_url=stack.gateway_url, timeout=10, headers=auth) as client:
        task_ids = [
            client.post("/v1/scores", json={"text": text}).json()["task_id"] for text in texts
        ]

        def all_completed() -> bool:
            views = [client.get(f"/v1/scores/{task_id}").json() for task_id in task_ids]
            return all(view["status"] == "completed" for view in views)

        wait_for(all_completed, timeout_s=120, what="both tasks completed")
    # The scheduler meters completions from a queue of its own: maybe after the poll saw them.
    wait_for(
        lambda: (
            Growth(before["scheduler"], scrape(stack, "scheduler")).of(
                "scorebox_deliveries_total", settled="ack"
            )
            >= 2
        ),
        timeout_s=30,
        what="the scheduler metered both completions",
    )
    after = {service: scrape(stack, service) for service in SERVICES}

    gateway = Growth(before["gateway"], after["gateway"])
    submits = {"method": "POST", "route": "/v1/scores", "status": "202"}
    assert gateway.of("scorebox_http_request_seconds_count", **submits) == 2
    confirmed = {"exchange": "scorebox.tasks", "outcome": "confirmed"}
    assert gateway.of("scorebox_publishes_total", **confirmed) == 2
    scorer = Growth(before["scorer"], after["scorer"])
    assert scorer.of("scorebox_model_calls_total", outcome="completed") == 2
    rate_limited = {"outcome": "transient", "code": "model_rate_limited"}
    assert scorer.of("scorebox_model_calls_total", **rate_limited) == 1
    assert scorer.of("scorebox_scorer_decisions_total", decision="completed") == 2
    assert scorer.of("scorebox_scorer_decisions_total", decision="retry") == 1
    assert scorer.of("scorebox_model_call_seconds_count") == 3
    assert ("scorebox_model_slots_busy", frozenset()) in after["scorer"]
    status = Growth(before["status"], after["status"])
    assert status.of("scorebox_deliveries_total", settled="ack") >= 4  # commands and outcomes


def test_the_gateways_metrics_need_the_metrics_or_the_admin_key(stack: Stack, api_key: str) -> None:
    """The scraper held the admin key, which also mints keys and replays dead letters; it
    holds a key that opens `/metrics` alone."""
    tenant = httpx.get(
        f"{stack.gateway_url}/metrics", headers={"Authorization": f"Bearer {api_key}"}, timeout=10
    )
    anonymous = httpx.get(f"{stack.gateway_url}/metrics", timeout=10)
    assert (tenant.status_code, anonymous.status_code) == (401, 401)
    scraper = {"Authorization": f"Bearer {METRICS_KEY}"}
    assert httpx.get(f"{stack.gateway_url}/metrics", headers=scraper, timeout=10).status_code == 200
    keys = httpx.get(f"{stack.gateway_url}/admin/v1/keys", headers=scraper, timeout=10)
    assert keys.status_code == 401
    for service in SERVICES[1:]:  # internal services: not published outside their network
        assert httpx.get(f"{stack.url(service)}/metrics", timeout=10).status_code == 200
