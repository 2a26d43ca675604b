"""The Celery baseline's app: `celery -A bench.celery_app worker -P gevent -c C`.

The task does what a Scorebox scorer does for one text, minus everything Scorebox adds
around it (claims, events, projection): it builds the same chat messages, POSTs them to the
same fake model with one shared HTTP session per worker process (`requests.Session` under
gevent's monkey-patching, its pool sized to the concurrency) and parses the verdict with the
scorer's own parser. Results are written nowhere (`ignore_result`): the baseline is the
cheapest honest Celery setup, and Scorebox's projection is extra work on its side.

Configured from the environment by `bench.celery_baseline` (this module is a worker's
configuration, so it reads it at import): `BENCH_CELERY_BROKER`, `BENCH_MODEL_URL`,
`BENCH_CONCURRENCY`, `BENCH_CELERY_QUEUE_TYPE` (`classic`, Celery's default, or `quorum`).
"""

from __future__ import annotations

import os
import threading
from typing import Any, Final

import requests
from celery import Celery  # type: ignore[import-untyped, import-not-found, unused-ignore]
from requests.adapters import HTTPAdapter

from services.scorer.model.parsing import parse_verdict
from services.scorer.model.prompt import VERDICT_JSON_SCHEMA, build_messages

QUEUE: Final = "bench.score"
TASK: Final = "bench.score"
CONNECT_TIMEOUT_S: Final = 10.0
READ_TIMEOUT_S: Final = 30.0

_broker = os.environ.get("BENCH_CELERY_BROKER", "amqp://guest:guest@127.0.0.1:5672//")
_model_url = os.environ.get("BENCH_MODEL_URL", "http://127.0.0.1:9/v1").rstrip("/")
_concurrency = int(os.environ.get("BENCH_CONCURRENCY", "64"))
_queue_type = os.environ.get("BENCH_CELERY_QUEUE_TYPE", "classic")

app = Celery("bench", broker=_broker)
app.conf.update(
    task_ignore_result=True,
    # At-least-once like Scorebox: ack after the task ran; prefetch = concurrency.
    task_acks_late=True,
    worker_prefetch_multiplier=1,
    task_default_queue=QUEUE,
    task_default_queue_type=_queue_type,
    worker_detect_quorum_queues=True,
    task_serializer="json",
    accept_content=["json"],
    broker_connection_retry_on_startup=True,
    # The producer waits for each publisher confirm, as the gateway does.
    broker_transport_options={"confirm_publish": True},
    worker_hijack_root_logger=False,
    worker_send_task_events=False,
)

_session_lock = threading.Lock()
_session: requests.Session | None = None


def shared_session() -> requests.Session:
    """One HTTP session per worker process, its pool holding `concurrency` connections."""
    global _session  # noqa: PLW0603 - one session per process is the point
    with _session_lock:
        if _session is None:
            session = requests.Session()
            adapter = HTTPAdapter(
                pool_connections=1, pool_maxsize=_concurrency, pool_block=True, max_retries=0
            )
            session.mount("http://", adapter)
            session.headers["Authorization"] = "Bearer bench"
            _session = session
        return _session


def request_body(text: str) -> dict[str, Any]:
    return {
        "model": "fake-judge-1",
        "messages": build_messages(text, None),
        "temperature": 0,
        "max_tokens": 300,
        "response_format": {"type": "json_schema", "json_schema": VERDICT_JSON_SCHEMA},
    }


@app.task(name=TASK)  # type: ignore[untyped-decorator]
def score(text: str) -> None:
    """Score one text with the fake model; raise on anything but a usable verdict."""
    response = shared_session().post(
        f"{_model_url}/chat/completions",
        json=request_body(text),
        timeout=(CONNECT_TIMEOUT_S, READ_TIMEOUT_S),
    )
    response.raise_for_status()
    parse_verdict(response.json()["choices"][0]["message"]["content"])
