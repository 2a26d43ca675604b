"""A local HTTPS webhook receiver: see signed webhooks arrive on a development machine.

`WEBHOOKS=local make run` starts one and sets the notifier up to reach it; by hand::

    python -m devtools.webhook_receiver [--host 127.0.0.1] [--port 0]
        [--name receiver.scorebox.test] [--ca-file PATH] [--fail N]
        [--secret whsec_... | --gateway URL] [--exit-with-parent]

The notifier delivers only to `https://` URLs whose host is a public-looking name, checks the
certificate and refuses non-public addresses. So this receiver serves under a name
(`receiver.scorebox.test`; `.test` is reserved, RFC 2606, and the gateway takes it) with a
certificate of a throwaway CA (`trustme`, made anew at every start, its PEM written to
`--ca-file`, a temporary file by default), and announces what the notifier needs to reach it:
one JSON line on stdout once it listens::

    {"url": "https://receiver.scorebox.test:PORT/hooks", "ca_file": "...",
     "notifier_env": {"WEBHOOK_CA_FILE": "...", "WEBHOOK_ALLOWED_TEST_HOSTS": "...",
                      "WEBHOOK_TEST_HOST_ADDRESSES": "receiver.scorebox.test=127.0.0.1"}}

Those three settings are for tests and this receiver only: they exempt the name from the
address check, answer its lookups from a table, and trust this CA instead of the system's.

Then it prints one line per delivery (any POST path) and answers 200, or 500 to the first N
with `--fail N` so the notifier's retries can be seen (they back off `WEBHOOK_RETRY_BASE_S`,
30 s by default, doubling)::

    delivery 1: task.completed task=9f0c... status=completed purpose=callback
      webhook-id=msg_... (try 1) signature ok; answered 200

The signature is checked (Standard Webhooks) with the secret given by `--secret`, or read
from `GET <gateway>/v1/webhooks/secret` with the API key in `SCOREBOX_API_KEY` (the
environment, never the command line: `ps` shows arguments) at the first delivery and again
when a signature does not match (a rotated secret). That is the secret of the API key's
tenant: another tenant's webhooks read "signature FAILED". Without either: "not checked".
Runs until SIGINT or SIGTERM (or, with `--exit-with-parent`, until its starter is gone).
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import os
import shutil
import ssl
import sys
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import orjson
import trustme
from aiohttp import web
from standardwebhooks import Webhook
from standardwebhooks.webhooks import WebhookVerificationError

from devtools.lifetime import run_until_stopped, starter_to_outlive

DEFAULT_NAME = "receiver.scorebox.test"
PATH = "/hooks"
SECRET_TIMEOUT_S = 5.0
SHUTDOWN_TIMEOUT_S = 2.0
WILDCARD_HOSTS = {"0.0.0.0": "127.0.0.1", "": "127.0.0.1", "::": "::1"}
STATE_KEY: web.AppKey[ReceiverState] = web.AppKey("state")
SECRET_PREFIX = "whsec_"
# `_verify`'s word for secrets none of which the library could take (`secret_problem`).
NO_USABLE_SECRET = "no usable secret"


def secret_problem(secret: str) -> str | None:
    """Why `secret` cannot sign nor check a signature, or None when it can: Standard
    Webhooks' `whsec_` (optional, as the library takes it) then the key in base64, padded or
    not. Checked strictly: the library skips what is not base64 (`whsec_a b` is `ab`'s key,
    every signature then FAILED) and raises `EmptyWebhookSecretError`, no `ValueError`, for
    nothing left (`whsec_`, `whsec_!!`). Never quotes the secret."""
    key = secret.removeprefix(SECRET_PREFIX)
    if not key:
        return "it is empty after whsec_" if secret else "it is empty"
    try:
        decoded = base64.b64decode(key + "=" * (-len(key) % 4), validate=True)
    except (binascii.Error, ValueError):
        return "its key is not base64"
    if not decoded:
        return "it holds no key"
    try:
        Webhook(secret)
    except Exception as error:  # noqa: BLE001 - whatever the library refuses it with
        return f"the library refuses it ({type(error).__name__})"
    return None


class SecretSource:
    """Where the tenant's signing secrets come from: given, or read from the gateway."""

    def __init__(
        self, *, secret: str | None = None, gateway_url: str | None = None, api_key: str = ""
    ) -> None:
        self._given = [secret] if secret else []
        self._gateway_url = gateway_url.rstrip("/") if gateway_url else None
        self._api_key = api_key
        self._read: list[str] = []

    @property
    def available(self) -> bool:
        return bool(self._given) or self._gateway_url is not None

    async def check(self, body: bytes, headers: dict[str, str]) -> str:
        """The verdict: `ok`, `FAILED (why)` or `not checked (why)`."""
        if not self.available:
            return "not checked (no secret: --secret or --gateway)"
        problem = ""
        if self._given or self._read:
            problem = _verify(self._given + self._read, body, headers)
            if not problem:
                return "ok"
        if self._gateway_url is None:
            if problem == NO_USABLE_SECRET:  # nothing to check with, not a forgery
                return f"not checked ({NO_USABLE_SECRET})"
            return f"FAILED ({problem})"
        try:
            self._read = [await self._fetch()]  # first delivery, or a rotated secret
        except (httpx.HTTPError, ValueError, KeyError) as error:
            return f"not checked (the secret could not be read from the gateway: {error})"
        problem = _verify(self._read, body, headers)
        return "ok" if not problem else f"FAILED ({problem}; not the API key's tenant?)"

    async def _fetch(self) -> str:
        async with httpx.AsyncClient(trust_env=False, timeout=SECRET_TIMEOUT_S) as client:
            response = await client.get(
                f"{self._gateway_url}/v1/webhooks/secret",
                headers={"Authorization": f"Bearer {self._api_key}"},
            )
        if response.status_code != 200:
            raise ValueError(f"GET /v1/webhooks/secret answered {response.status_code}")
        answer = orjson.loads(response.content)
        secret = answer.get("secret") if isinstance(answer, dict) else None
        if not isinstance(secret, str) or secret_problem(secret) is not None:
            raise ValueError("GET /v1/webhooks/secret answered no usable secret")
        return secret


def _verify(secrets: list[str], body: bytes, headers: dict[str, str]) -> str:
    """Empty when a signature matches one of `secrets`, else why not (`NO_USABLE_SECRET`
    when none of them is one the library takes). Never raises for a secret: a malformed one
    raised `EmptyWebhookSecretError` out of the handler, a 500 and no line for every
    delivery."""
    problem = NO_USABLE_SECRET if secrets else "no secret"
    for secret in secrets:
        try:
            webhook = Webhook(secret)
        except Exception:  # noqa: BLE001 - whatever the library refuses a secret with
            continue
        try:
            webhook.verify(body, headers, json_parse=False)
        except WebhookVerificationError as error:
            problem = str(error)
        except ValueError as error:  # a body that is not UTF-8, a malformed header
            problem = f"{type(error).__name__}: {error}"
        else:
            return ""
    return problem


@dataclass
class ReceiverState:
    """What the receiver has seen; `report` prints a line (stdout, or a test's list)."""

    secrets: SecretSource
    fail: int = 0
    report: Callable[[str], None] = print
    deliveries: int = 0
    tries: Counter[str] = field(default_factory=Counter)
    lines: list[str] = field(default_factory=list)

    def say(self, line: str) -> None:
        self.lines.append(line)
        self.report(line)


def describe(body: bytes) -> str:
    """The event type, task, status and purpose of a webhook body (what can be read of it)."""
    try:
        payload = orjson.loads(body)
        data = payload.get("data") or {}
        return (
            f"{payload.get('type')} task={data.get('task_id')} status={data.get('status')} "
            f"purpose={data.get('purpose')}"
        )
    except (orjson.JSONDecodeError, AttributeError):
        return f"a body that is not a webhook's JSON ({len(body)} bytes)"


async def _deliver(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    body = await request.read()
    headers = {key.lower(): value for key, value in request.headers.items()}
    state.deliveries += 1
    number = state.deliveries
    webhook_id = headers.get("webhook-id", "(none)")
    state.tries[webhook_id] += 1
    signature = await state.secrets.check(body, headers)
    status = 500 if number <= state.fail else 200
    note = f" (--fail {state.fail})" if status == 500 else ""
    state.say(
        f"delivery {number}: {describe(body)} webhook-id={webhook_id} "
        f"(try {state.tries[webhook_id]}) to {request.path} signature {signature}; "
        f"answered {status}{note}"
    )
    return web.Response(status=status, text="failed on purpose" if status == 500 else "ok")


def build_app(state: ReceiverState) -> web.Application:
    app = web.Application()
    app[STATE_KEY] = state
    app.router.add_post("/{path:.*}", _deliver)
    return app


def make_tls(name: str, ca_file: Path) -> ssl.SSLContext:
    """A new CA, a server certificate for `name` from it, the CA's PEM at `ca_file`."""
    ca = trustme.CA()
    server = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert(name).configure_cert(server)
    ca_file.parent.mkdir(parents=True, exist_ok=True)
    ca.cert_pem.write_to_path(str(ca_file))
    return server


class WebhookReceiver:
    """Handle of a running receiver."""

    def __init__(
        self, runner: web.AppRunner, state: ReceiverState, *, url: str, ca_file: Path, name: str
    ) -> None:
        self._runner = runner
        self.state = state
        self.url = url
        self.ca_file = ca_file
        self.name = name

    def notifier_env(self, address: str) -> dict[str, str]:
        """The notifier's settings that reach this receiver (tests and dev runs only)."""
        return {
            "WEBHOOK_CA_FILE": str(self.ca_file),
            "WEBHOOK_ALLOWED_TEST_HOSTS": self.name,
            "WEBHOOK_TEST_HOST_ADDRESSES": f"{self.name}={address}",
        }

    async def stop(self) -> None:
        await self._runner.cleanup()


async def start_receiver(
    state: ReceiverState,
    *,
    ca_file: Path,
    name: str = DEFAULT_NAME,
    host: str = "127.0.0.1",
    port: int = 0,
) -> WebhookReceiver:
    """Listen on `host:port` (0: a free port) with TLS for `name`; the CA goes to `ca_file`."""
    tls = make_tls(name, ca_file)
    runner = web.AppRunner(build_app(state), access_log=None, shutdown_timeout=SHUTDOWN_TIMEOUT_S)
    await runner.setup()
    try:
        await web.TCPSite(runner, host, port, ssl_context=tls).start()
    except BaseException:
        await runner.cleanup()
        raise
    bound_port = runner.addresses[0][1]
    return WebhookReceiver(
        runner, state, url=f"https://{name}:{bound_port}{PATH}", ca_file=ca_file, name=name
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m devtools.webhook_receiver",
        description="A local HTTPS webhook receiver that prints and checks each delivery.",
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--name", default=DEFAULT_NAME, help="the host name it serves under")
    parser.add_argument(
        "--ca-file", type=Path, default=None, help="where to write the CA (default: a temp file)"
    )
    parser.add_argument("--fail", type=int, default=0, metavar="N", help="answer 500 to N first")
    secret = parser.add_mutually_exclusive_group()
    secret.add_argument("--secret", default=None, help="the tenant's signing secret (whsec_...)")
    secret.add_argument(
        "--gateway",
        default=None,
        metavar="URL",
        help="read the secret of SCOREBOX_API_KEY's tenant from this gateway",
    )
    parser.add_argument("--exit-with-parent", action="store_true")
    args = parser.parse_args(argv)
    if args.fail < 0:
        parser.error("--fail must be 0 or more")
    if args.secret is not None and (problem := secret_problem(args.secret)) is not None:
        parser.error(
            f"--secret is not a usable signing secret ({SECRET_PREFIX} and the key in base64, "
            f"as GET /v1/webhooks/secret gives it): {problem}"
        )
    return args


@contextlib.contextmanager
def _ca_path(given: Path | None) -> Iterator[Path]:
    if given is not None:
        yield given
        return
    folder = tempfile.mkdtemp(prefix="scorebox-webhook-ca-")
    try:
        yield Path(folder) / "ca.pem"
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _print_flushed(line: str) -> None:
    print(line, flush=True)


async def serve(args: argparse.Namespace) -> None:
    """Run until stopped: the JSON announcement, a readable summary, then a line a delivery."""
    parent_pid = starter_to_outlive(exit_with_parent=args.exit_with_parent)
    secrets = SecretSource(
        secret=args.secret,
        gateway_url=args.gateway,
        api_key=os.environ.get("SCOREBOX_API_KEY", ""),
    )
    if args.gateway and not os.environ.get("SCOREBOX_API_KEY"):
        print("warning: --gateway without SCOREBOX_API_KEY: the secret cannot be read", flush=True)
    state = ReceiverState(secrets=secrets, fail=args.fail, report=_print_flushed)
    with _ca_path(args.ca_file) as ca_file:
        receiver = await start_receiver(
            state, ca_file=ca_file, name=args.name, host=args.host, port=args.port
        )
        try:
            address = WILDCARD_HOSTS.get(args.host, args.host)
            announcement: dict[str, Any] = {
                "url": receiver.url,
                "ca_file": str(ca_file),
                "notifier_env": receiver.notifier_env(address),
            }
            _print_flushed(orjson.dumps(announcement).decode())
            checked = (
                "checked with the given secret"
                if args.secret
                else f"checked with the secret read from {args.gateway}"
                if args.gateway
                else "not checked (no --secret or --gateway)"
            )
            answers = f"500 to the first {args.fail}, then 200" if args.fail else "200"
            _print_flushed(
                f"Receiving webhooks at {receiver.url} (listening on {address}); signatures "
                f"{checked}; answering {answers}."
            )
            await run_until_stopped(parent_pid=parent_pid)
        finally:
            await receiver.stop()


def main(argv: list[str] | None = None) -> int:
    asyncio.run(serve(parse_args(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
