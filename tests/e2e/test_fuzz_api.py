"""Fuzz the public API from its own OpenAPI document (schemathesis): no input yields a 5xx."""

from __future__ import annotations

from typing import Any

import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.core.result import Err

from devtools.stack import Stack

EXAMPLES_PER_OPERATION = 25


def test_no_generated_request_causes_a_server_error(stack: Stack, api_key: str) -> None:
    schema = schemathesis.openapi.from_url(f"{stack.gateway_url}/openapi.json")
    headers = {"Authorization": f"Bearer {api_key}"}
    failures: list[str] = []
    operations = 0
    for result in schema.get_all_operations():
        if isinstance(result, Err):
            raise result.err()
        operation = result.ok()
        operations += 1

        @given(case=operation.as_strategy())
        @settings(
            max_examples=EXAMPLES_PER_OPERATION,
            deadline=None,
            derandomize=True,
            suppress_health_check=list(HealthCheck),
        )
        def fuzz(case: Any) -> None:
            response = case.call(base_url=stack.gateway_url, headers=headers, timeout=30)
            if response.status_code >= 500:
                failures.append(
                    f"{case.method} {case.formatted_path} -> {response.status_code}: "
                    f"{response.text[:200]}"
                )

        fuzz()
    assert operations >= 10, "the OpenAPI document lost its operations"
    assert not failures, "\n".join(failures[:20])
