"""The services as separate processes, as `make run` starts them."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from devtools.stack import Stack, StackConfig
from services.gateway.keys import generate_key
from tests.support_sync import read_line_within

FAKE_LLM_LATENCY_MS = "20"
ADMIN_KEY = "e2e-admin-key"  # the admin routes, and the gateway's and the scheduler's /metrics
METRICS_KEY = "e2e-metrics-key"  # every service's /metrics, and nothing else


@pytest.fixture(scope="module")
def api_key() -> str:
    return generate_key().token


@pytest.fixture(scope="module")
def fake_llm_url() -> Iterator[str]:
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "devtools.fake_llm",
            "--port",
            "0",
            "--latency-ms",
            FAKE_LLM_LATENCY_MS,
            "--exit-with-parent",  # a test run killed hard leaves no server behind
        ],
        stdout=subprocess.PIPE,
    )
    try:
        line = read_line_within(process, timeout_s=30)
        yield str(json.loads(line)["url"])
    finally:
        process.terminate()
        process.wait(timeout=10)
        if process.stdout is not None:
            process.stdout.close()


@pytest.fixture(scope="module")
def stack(
    amqp_url: str,
    mongo: Any,
    db_prefix: str,
    fake_llm_url: str,
    api_key: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Stack]:
    config = StackConfig(
        rabbitmq_url=amqp_url,
        mongo_url=mongo.url,
        db_prefix=db_prefix,
        gateway_port=0,
        log_dir=Path(tmp_path_factory.mktemp("logs")),
        env={
            "LLM_PROVIDER": "openai",
            "LLM_BASE_URL": fake_llm_url,
            "LLM_API_KEY": "e2e-key",
            "LLM_MODEL": "fake-judge-1",
            "LLM_TIMEOUT_S": "5",
            "RETRY_BASE_S": "0.5",
            "BOOTSTRAP_API_KEY": api_key,
            "ADMIN_API_KEY": ADMIN_KEY,
            "METRICS_API_KEY": METRICS_KEY,
            "RATE_LIMIT_PER_MIN": "0",
        },
    )
    running = Stack(config)
    running.start(ready_timeout_s=90)
    try:
        yield running
    finally:
        running.stop()
