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
    """As Prometheus scrapes: with the one metrics key every service of the stack takes."""
    headers = stack.metrics_headers()
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


def _metrics_answer(stack: Stack, service: str, key: str | None = None) -> int:
    headers = {} if key is None else {"Authorization": f"Bearer {key}"}
    return httpx.get(f"{stack.url(service)}/metrics", headers=headers, timeout=10).status_code


def test_the_gateways_metrics_need_the_metrics_or_the_admin_key(stack: Stack, api_key: str) -> None:
    """The scraper held the admin key, which also mints keys and replays dead letters; it
    holds a key that opens `/metrics` alone."""
    refused = (_metrics_answer(stack, "gateway", api_key), _metrics_answer(stack, "gateway"))
    assert refused == (401, 401)
    assert _metrics_answer(stack, "gateway", METRICS_KEY) == 200
    assert _metrics_answer(stack, "gateway", ADMIN_KEY) == 200
    scraper = {"Authorization": f"Bearer {METRICS_KEY}"}
    keys = httpx.get(f"{stack.gateway_url}/admin/v1/keys", headers=scraper, timeout=10)
    assert keys.status_code == 401


def test_every_services_metrics_need_the_stacks_metrics_key(stack: Stack, api_key: str) -> None:
    """One key for the whole stack; the admin key opens only the scheduler's and the
    notifier's besides the gateway's (the others do not hold it)."""
    assert stack.metrics_key == METRICS_KEY
    for service in SERVICES[1:]:
        refused = (_metrics_answer(stack, service), _metrics_answer(stack, service, api_key))
        assert refused == (401, 401), service
        assert _metrics_answer(stack, service, METRICS_KEY) == 200, service
        admin = _metrics_answer(stack, service, ADMIN_KEY)
        assert admin == (200 if service in ("scheduler", "notifier") else 401), service
