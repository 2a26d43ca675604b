"""`scorebox keys ...` against a fake gateway (httpx.MockTransport): what it sends, what it
shows, how it fails."""

from __future__ import annotations

import json

import httpx
import pytest

from tests.unit.cli_support import cli_answered_by, run_cli


class FakeGateway:
    def __init__(self) -> None:
        self.requests: list[httpx.Request] = []
        self.answer: httpx.Response = httpx.Response(200, json={})

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.requests.append(request)
        return self.answer


@pytest.fixture
def gateway(monkeypatch: pytest.MonkeyPatch) -> FakeGateway:
    fake = FakeGateway()
    cli_answered_by(monkeypatch, fake, api_key="an-api-key")
    return fake


def test_create_posts_tenant_and_name_with_the_admin_key(gateway: FakeGateway) -> None:
    gateway.answer = httpx.Response(201, json={"key_id": "k", "key": "sbx_k_secret"})
    result = run_cli("keys", "create", "--tenant", "acme", "--name", "ci")
    assert result.exit_code == 0, result.output
    [request] = gateway.requests
    assert (request.method, request.url.path) == ("POST", "/admin/v1/keys")
    assert request.headers["authorization"] == "Bearer the-admin-key"
    assert json.loads(request.content) == {"tenant_id": "acme", "name": "ci"}
    assert json.loads(result.output)["key"] == "sbx_k_secret"


def test_create_sends_the_expiry_when_given(gateway: FakeGateway) -> None:
    gateway.answer = httpx.Response(201, json={"key_id": "k", "key": "sbx_k_secret"})
    result = run_cli("keys", "create", "--tenant", "acme", "--expires-in-days", "30")
    assert result.exit_code == 0, result.output
    [request] = gateway.requests
    body = json.loads(request.content)
    assert body == {"tenant_id": "acme", "name": "", "expires_in_days": 30}


def test_list_filters_by_tenant_when_asked(gateway: FakeGateway) -> None:
    gateway.answer = httpx.Response(200, json={"count": 0, "items": []})
    assert run_cli("keys", "list", "--tenant", "acme").exit_code == 0
    assert run_cli("keys", "list").exit_code == 0
    filtered, everyone = gateway.requests
    assert (filtered.method, filtered.url.path) == ("GET", "/admin/v1/keys")
    assert filtered.url.params["tenant_id"] == "acme"
    assert "tenant_id" not in everyone.url.params
    assert everyone.headers["authorization"] == "Bearer the-admin-key"


def test_revoke_deletes_the_key(gateway: FakeGateway) -> None:
    gateway.answer = httpx.Response(200, json={"key_id": "0123456789abcdef", "revoked_at": "x"})
    result = run_cli("keys", "revoke", "0123456789abcdef")
    assert result.exit_code == 0, result.output
    [request] = gateway.requests
    assert (request.method, request.url.path) == ("DELETE", "/admin/v1/keys/0123456789abcdef")


@pytest.mark.parametrize(
    "args", [("keys", "create", "--tenant", "a"), ("keys", "list"), ("keys", "revoke", "x")]
)
def test_a_refusal_is_reported_with_a_failing_exit_code(
    gateway: FakeGateway, args: tuple[str, ...]
) -> None:
    gateway.answer = httpx.Response(401, json={"detail": "Send the admin key."})
    result = run_cli(*args)
    assert result.exit_code == 1
    assert "401" in result.output
    assert "Send the admin key." in result.output
