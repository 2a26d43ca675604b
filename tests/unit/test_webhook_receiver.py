"""`devtools.webhook_receiver` in-process: TLS under its name, each delivery described, the
signature checked with the given secret (one it cannot use refused at start, and never a
500), `--fail N` answering 500 first."""

from __future__ import annotations

import ssl
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import orjson
import pytest
from aiohttp import web

from devtools.webhook_receiver import (
    ReceiverState,
    SecretSource,
    WebhookReceiver,
    describe,
    parse_args,
    start_receiver,
)
from services.notifier.signing import new_secret, signed_headers
from tests.support import serving

SECRET = new_secret()


async def _start(tmp_path: Path, **state: object) -> WebhookReceiver:
    quiet: list[str] = []
    return await start_receiver(
        ReceiverState(report=quiet.append, **state),  # type: ignore[arg-type]
        ca_file=tmp_path / "ca.pem",
    )


@pytest.fixture
async def receiver(tmp_path: Path) -> AsyncIterator[WebhookReceiver]:
    started = await _start(tmp_path, secrets=SecretSource(secret=SECRET), fail=1)
    try:
        yield started
    finally:
        await started.stop()


async def _post(receiver: WebhookReceiver, secret: str, body: bytes) -> int:
    """POST as the notifier does: to 127.0.0.1, with the receiver's name for SNI."""
    port = receiver.url.rsplit(":", 1)[1].split("/", 1)[0]
    headers = signed_headers([secret], webhook_id="msg_1", timestamp=int(time.time()), body=body)
    context = ssl.create_default_context(cafile=str(receiver.ca_file))
    async with httpx.AsyncClient(verify=context, trust_env=False) as client:
        response = await client.post(
            f"https://127.0.0.1:{port}/hooks",
            content=body,
            headers={**headers, "Host": receiver.name},
            extensions={"sni_hostname": receiver.name},
        )
    return response.status_code


BODY = orjson.dumps(
    {"type": "task.failed", "data": {"task_id": "t1", "status": "failed", "purpose": "callback"}}
)


async def test_each_delivery_is_described_and_its_signature_checked(
    receiver: WebhookReceiver,
) -> None:
    assert receiver.url.startswith("https://receiver.scorebox.test:")
    assert await _post(receiver, SECRET, BODY) == 500  # --fail 1
    assert await _post(receiver, SECRET, BODY) == 200
    assert await _post(receiver, new_secret(), BODY) == 200

    first, second, forged = receiver.state.lines
    assert "delivery 1: task.failed task=t1 status=failed purpose=callback" in first
    assert "webhook-id=msg_1 (try 1)" in first
    assert "signature ok; answered 500 (--fail 1)" in first
    assert "(try 2)" in second
    assert "signature ok; answered 200" in second
    assert "signature FAILED (No matching signature found)" in forged


async def test_without_a_secret_the_signature_is_not_checked(tmp_path: Path) -> None:
    receiver = await _start(tmp_path, secrets=SecretSource())
    try:
        assert await _post(receiver, SECRET, BODY) == 200
    finally:
        await receiver.stop()

    [line] = receiver.state.lines
    assert "signature not checked (no secret" in line


async def test_the_secret_is_read_from_the_gateway_and_again_after_a_rotation(
    tmp_path: Path,
) -> None:
    current = [SECRET]
    asked: list[str] = []

    async def secret_route(request: web.Request) -> web.Response:
        asked.append(request.headers["Authorization"])
        return web.json_response({"secret": current[0]})

    gateway = web.Application()
    gateway.router.add_get("/v1/webhooks/secret", secret_route)
    async with serving(gateway) as gateway_url:
        source = SecretSource(gateway_url=gateway_url, api_key="sbx_key")
        receiver = await _start(tmp_path, secrets=source)
        try:
            await _post(receiver, SECRET, BODY)
            await _post(receiver, SECRET, BODY)  # the secret read before still matches
            current[0] = new_secret()  # rotated: the next webhook is signed with the new one
            await _post(receiver, current[0], BODY)
        finally:
            await receiver.stop()

    assert [line.rsplit("signature ", 1)[1] for line in receiver.state.lines] == [
        "ok; answered 200"
    ] * 3
    assert asked == ["Bearer sbx_key", "Bearer sbx_key"]


def test_a_body_that_is_not_a_webhook_is_described_as_such() -> None:
    assert describe(b"\xff not json") == "a body that is not a webhook's JSON (10 bytes)"


# Secrets the library cannot take: `EmptyWebhookSecretError` (no `ValueError`) for nothing
# left once `whsec_` and what is not base64 are taken out, `binascii.Error` for a bad length;
# and one it takes as another key (`whsec_a b` is `ab`'s).
UNUSABLE_SECRETS = ["", "whsec_", "whsec_!!!", "whsec_a", "whsec_a b", "whsec_===="]


@pytest.mark.parametrize("secret", UNUSABLE_SECRETS)
def test_a_secret_it_cannot_use_is_refused_at_start_without_quoting_it(
    capsys: pytest.CaptureFixture[str], secret: str
) -> None:
    with pytest.raises(SystemExit) as exited:
        parse_args(["--secret", secret])

    assert exited.value.code == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert "error: --secret is not a usable signing secret" in error
    assert len(secret) < len("whsec_!!!") or secret not in error


def test_a_secret_as_the_gateway_gives_it_is_taken() -> None:
    assert parse_args(["--secret", SECRET]).secret == SECRET
    assert parse_args(["--secret", SECRET.rstrip("=")]).secret == SECRET.rstrip("=")


@pytest.mark.parametrize("secret", ["whsec_", "whsec_!!!", "whsec_a"])
async def test_a_secret_it_cannot_use_never_fails_a_delivery(tmp_path: Path, secret: str) -> None:
    """Given past the start check (in-process), the library's `EmptyWebhookSecretError` came
    out of the handler: every delivery answered 500 and no line was printed (found in a
    walkthrough)."""
    receiver = await _start(tmp_path, secrets=SecretSource(secret=secret))
    try:
        assert await _post(receiver, SECRET, BODY) == 200
    finally:
        await receiver.stop()

    [line] = receiver.state.lines
    assert "delivery 1: task.failed" in line
    assert line.endswith("signature not checked (no usable secret); answered 200")


@pytest.mark.parametrize("answer", [{"secret": "whsec_"}, ["whsec_x"], None, "whsec_x"])
async def test_a_secret_from_the_gateway_it_cannot_use_is_said_so(
    tmp_path: Path, answer: object
) -> None:
    """JSON that is no object (a list, `null`, a string) raised `TypeError` out of the
    handler: a 500 and no line (a review)."""

    async def secret_route(request: web.Request) -> web.Response:
        return web.json_response(answer)

    gateway = web.Application()
    gateway.router.add_get("/v1/webhooks/secret", secret_route)
    async with serving(gateway) as gateway_url:
        receiver = await _start(
            tmp_path, secrets=SecretSource(gateway_url=gateway_url, api_key="k")
        )
        try:
            assert await _post(receiver, SECRET, BODY) == 200
        finally:
            await receiver.stop()

    [line] = receiver.state.lines
    assert "signature not checked (the secret could not be read from the gateway" in line
    assert "no usable secret" in line
