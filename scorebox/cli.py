"""`scorebox`: the command line client of a Scorebox gateway.

    scorebox submit FILE [--rubric R] [--wait]     submit a text (FILE or - for stdin)
    scorebox status TASK_ID                        show a task
    scorebox dlq list | show ID | replay [ID...|--all] | purge
    scorebox keys create --tenant T [--name N] | list [--tenant T] | revoke KEY_ID

The gateway is `SCOREBOX_URL` (default http://127.0.0.1:8000); `SCOREBOX_API_KEY`, when set,
is sent as a bearer token; admin commands (`dlq`, `keys`) send `SCOREBOX_ADMIN_KEY` instead.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Annotated, Any

import httpx
import typer

app = typer.Typer(help="Command line client of Scorebox.", no_args_is_help=True)
dlq = typer.Typer(help="Operate the dead-letter queue (needs SCOREBOX_ADMIN_KEY).")
app.add_typer(dlq, name="dlq")

TERMINAL = {"completed", "failed"}
REQUEST_TIMEOUT_S = 30.0


def _client(*, admin: bool = False) -> httpx.Client:
    headers = {}
    if key := os.environ.get("SCOREBOX_ADMIN_KEY" if admin else "SCOREBOX_API_KEY"):
        headers["Authorization"] = f"Bearer {key}"
    base_url = os.environ.get("SCOREBOX_URL", "http://127.0.0.1:8000")
    return httpx.Client(base_url=base_url, headers=headers, timeout=REQUEST_TIMEOUT_S)


def _fail(response: httpx.Response) -> typer.Exit:
    try:
        detail = response.json().get("detail", response.text)
    except ValueError:
        detail = response.text
    typer.echo(f"error {response.status_code}: {detail}", err=True)
    return typer.Exit(code=1)


def _show(body: dict[str, Any]) -> None:
    typer.echo(json.dumps(body, indent=2, ensure_ascii=False))


def _wait(client: httpx.Client, task_id: str, timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    delay = 0.2
    while True:
        response = client.get(f"/v1/scores/{task_id}")
        if response.status_code != 200:
            raise _fail(response)
        body: dict[str, Any] = response.json()
        if body["status"] in TERMINAL or time.monotonic() > deadline:
            return body
        time.sleep(delay)
        delay = min(delay * 1.5, 3.0)


@app.command()
def submit(
    file: Annotated[Path, typer.Argument(help="The text to score; - reads stdin.")],
    rubric: Annotated[str | None, typer.Option(help="What to judge the text on.")] = None,
    wait: Annotated[bool, typer.Option("--wait", help="Poll until the task finishes.")] = False,
    timeout: Annotated[float, typer.Option(help="Seconds --wait polls at most.")] = 300.0,
    idempotency_key: Annotated[str | None, typer.Option(help="Idempotency-Key header.")] = None,
) -> None:
    """Submit a text for scoring and print the task (or, with --wait, its result)."""
    text = sys.stdin.read() if str(file) == "-" else file.read_text(encoding="utf-8")
    payload: dict[str, Any] = {"text": text}
    if rubric:
        payload["rubric"] = rubric
    headers = {"Idempotency-Key": idempotency_key} if idempotency_key else {}
    with _client() as client:
        response = client.post("/v1/scores", json=payload, headers=headers)
        if response.status_code not in (200, 202):
            raise _fail(response)
        body: dict[str, Any] = response.json()
        if wait:
            body = _wait(client, body["task_id"], timeout)
        _show(body)
        if body["status"] == "failed":
            raise typer.Exit(code=2)


@app.command()
def status(task_id: str) -> None:
    """Show a task's status and, once completed, its score."""
    with _client() as client:
        response = client.get(f"/v1/scores/{task_id}")
        if response.status_code != 200:
            raise _fail(response)
        _show(response.json())


def _admin_call(method: str, path: str, **kwargs: Any) -> None:
    with _client(admin=True) as client:
        response = client.request(method, path, **kwargs)
        if response.status_code != 200:
            raise _fail(response)
        _show(response.json())


@dlq.command("list")
def dlq_list() -> None:
    """List dead letters with their reason, attempts and age."""
    _admin_call("GET", "/admin/v1/dead-letters")


@dlq.command("show")
def dlq_show(letter_id: str) -> None:
    """Show one dead letter by message id or task id."""
    _admin_call("GET", f"/admin/v1/dead-letters/{letter_id}")


@dlq.command("replay")
def dlq_replay(
    ids: Annotated[list[str] | None, typer.Argument(help="Message or task ids.")] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="Replay every dead letter.")] = False,
) -> None:
    """Send dead letters back to the work queue with a fresh attempt budget."""
    if replay_all == bool(ids):
        typer.echo("give ids or --all (not both)", err=True)
        raise typer.Exit(code=2)
    body = {"all": True} if replay_all else {"ids": ids}
    _admin_call("POST", "/admin/v1/dead-letters/replay", json=body)


@dlq.command("purge")
def dlq_purge(yes: Annotated[bool, typer.Option("--yes", help="Do not ask.")] = False) -> None:
    """Delete every dead letter."""
    if not yes:
        typer.confirm("Delete every dead letter?", abort=True)
    _admin_call("DELETE", "/admin/v1/dead-letters")


keys = typer.Typer(help="Manage API keys (needs SCOREBOX_ADMIN_KEY).")
app.add_typer(keys, name="keys")


@keys.command("create")
def keys_create(
    tenant: Annotated[str, typer.Option(help="The tenant the key acts for.")],
    name: Annotated[str, typer.Option(help="What the key is for.")] = "",
) -> None:
    """Create a key and print it: the `key` field is shown this once, never again."""
    with _client(admin=True) as client:
        response = client.post("/admin/v1/keys", json={"tenant_id": tenant, "name": name})
        if response.status_code != 201:
            raise _fail(response)
        _show(response.json())


@keys.command("list")
def keys_list(
    tenant: Annotated[str | None, typer.Option(help="Only this tenant's keys.")] = None,
) -> None:
    """List keys (ids, tenants, names, dates; never a secret)."""
    _admin_call("GET", "/admin/v1/keys", params={"tenant_id": tenant} if tenant else None)


@keys.command("revoke")
def keys_revoke(key_id: str) -> None:
    """Revoke a key; every gateway refuses it within a few seconds (API_KEY_CACHE_TTL_S)."""
    _admin_call("DELETE", f"/admin/v1/keys/{key_id}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()
