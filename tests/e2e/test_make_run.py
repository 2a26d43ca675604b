"""`make run`'s entry point: start everything, follow the printed instructions, stop cleanly."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.gateway.keys import generate_key
from tests.support_sync import LineCollector, wait_for

SERVICES = ("GATEWAY", "STATUS", "SCORER", "SCHEDULER", "NOTIFIER")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _port_free(port: int) -> bool:
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) != 0


@pytest.fixture
def make_run(
    amqp_url: str, mongo: Any, db_prefix: str, tmp_path: Path, request: pytest.FixtureRequest
) -> Any:
    """`make run` started; `request.param` (indirect parametrisation) adds to its env."""
    ports = {f"{name}_PORT": str(_free_port()) for name in SERVICES}
    env = {
        **os.environ,
        **getattr(request, "param", {}),
        **ports,
        "RABBITMQ_URL": amqp_url,
        "MONGO_URL": mongo.url,
        "MONGO_DB_PREFIX": f"{db_prefix}run",
        "LLM_PROVIDER": "heuristic",
        "SCOREBOX_API_KEY": generate_key().token,
    }
    process = subprocess.Popen(
        [sys.executable, "-m", "devtools.stack", "run", "--log-dir", str(tmp_path / "logs")],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
    )
    output = LineCollector(process)
    try:
        banner = output.wait_for_text("Ctrl-C stops everything", timeout_s=120)
        yield process, banner, ports, env["SCOREBOX_API_KEY"], output
    finally:
        if process.poll() is None:
            process.terminate()  # lets `make run` stop what it started
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=30)
        if process.stdout is not None:
            process.stdout.close()


def test_make_run_serves_the_readme_example_and_stops_on_sigterm(make_run: Any) -> None:
    process, banner, ports, api_key, output = make_run
    gateway = f"http://127.0.0.1:{ports['GATEWAY_PORT']}"
    auth = {"Authorization": f"Bearer {api_key}"}
    assert f"Gateway:  {gateway}" in banner
    assert "Model:    built-in heuristic" in banner  # which model the scorers call
    assert "Webhooks:" not in banner  # no local receiver unless asked (WEBHOOKS=local)
    assert f"-H 'Authorization: Bearer {api_key}'" in banner  # the curl example is ready to paste
    assert f"export SCOREBOX_API_KEY={api_key}" in banner
    # `scorebox cron` defaults to port 8003: with the port moved, the export points it here.
    scheduler = f"http://127.0.0.1:{ports['SCHEDULER_PORT']}"
    assert f"export SCOREBOX_SCHEDULER_URL={scheduler}" in banner
    notifier = f"http://127.0.0.1:{ports['NOTIFIER_PORT']}"
    assert f"export SCOREBOX_NOTIFIER_URL={notifier}" in banner

    submitted = httpx.post(
        f"{gateway}/v1/scores",
        json={"text": "The quick brown fox jumps over the lazy dog."},
        headers=auth,
        timeout=10,
    )
    assert submitted.status_code == 202
    task_url = f"{gateway}/v1/scores/{submitted.json()['task_id']}"

    def completed() -> dict[str, Any] | None:
        view: dict[str, Any] = httpx.get(task_url, headers=auth, timeout=10).json()
        return view if view["status"] == "completed" else None

    view = wait_for(completed, timeout_s=60, what="the README example completed")
    assert view["result"]["model"] == "heuristic-v1"

    # The banner's CLI example, as printed (its README example once exceeded the text limit).
    example = next(line.strip() for line in banner.splitlines() if "scorebox submit" in line)
    cli = subprocess.run(
        example.replace(".venv/bin/scorebox", f"{sys.executable} -m scorebox.cli"),
        shell=True,  # the banner's own line, run as a user pastes it
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "SCOREBOX_URL": gateway, "SCOREBOX_API_KEY": api_key},
        check=False,
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["status"] == "completed"
    # The webhook DLQ, on the notifier, with the banner's exports and admin key as pasted.
    listing = subprocess.run(
        [sys.executable, "-m", "scorebox.cli", "webhooks", "dlq", "list"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, **_exports(banner)},
        check=False,
    )
    assert listing.returncode == 0, listing.stderr
    assert json.loads(listing.stdout)["truncated"] is False

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert "Stopped." in output.wait_for_text("Stopped.", timeout_s=10)
    for port in ports.values():
        assert _port_free(int(port)), f"port {port} still served after make run stopped"


def _exports(banner: str) -> dict[str, str]:
    """The banner's `export NAME=VALUE` lines."""
    exports = {}
    for line in banner.splitlines():
        if line.strip().startswith("export "):
            name, _, value = line.strip().removeprefix("export ").partition("=")
            exports[name] = value
    return exports


@pytest.mark.parametrize("make_run", [{"WEBHOOKS": "local"}], indirect=True)
def test_make_run_with_local_webhooks_delivers_the_banners_callback_signed(
    make_run: Any,
) -> None:
    process, banner, _ports, _api_key, output = make_run
    assert "Webhooks: a local receiver at https://receiver.scorebox.test:" in banner
    assert "signatures checked with the default tenant's secret" in banner
    log_path = Path(
        next(line for line in banner.splitlines() if "tail -f" in line).split("tail -f ", 1)[1]
    )
    example = next(line.strip() for line in banner.splitlines() if '"callback_url"' in line)
    callback_url = example.split('"callback_url": "', 1)[1].split('"', 1)[0]
    assert callback_url.startswith("https://receiver.scorebox.test:")

    submitted = subprocess.run(
        example,
        shell=True,  # the banner's own line, run as a user pastes it
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert submitted.returncode == 0, submitted.stderr
    task_id = json.loads(submitted.stdout)["task_id"]

    def delivered() -> str | None:
        lines = [line for line in log_path.read_text().splitlines() if f"task={task_id}" in line]
        return lines[0] if lines else None

    line = wait_for(delivered, timeout_s=60, what=f"the receiver's line for {task_id}")
    assert "task.completed" in line
    assert "signature ok; answered 200" in line

    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 0
    assert "Stopped." in output.wait_for_text("Stopped.", timeout_s=10)
    receiver_port = int(callback_url.rsplit(":", 1)[1].split("/", 1)[0])
    assert _port_free(receiver_port), "the receiver still listens after make run stopped"
