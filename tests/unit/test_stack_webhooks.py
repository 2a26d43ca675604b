"""`WEBHOOKS=local make run` (`devtools.stack run --webhooks-local`): the receiver it starts,
the notifier settings it adds, and nothing of it without the option."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from devtools.stack import (
    LocalReceiver,
    gateway_url_before_start,
    local_webhook_receiver,
    parse_args,
    with_receiver_env,
)

RECEIVER = LocalReceiver(
    url="https://receiver.scorebox.test:4443/hooks",
    log_path=Path("logs/webhook-receiver.log"),
    notifier_env={
        "WEBHOOK_CA_FILE": "/tmp/run/ca.pem",
        "WEBHOOK_ALLOWED_TEST_HOSTS": "receiver.scorebox.test",
        "WEBHOOK_TEST_HOST_ADDRESSES": "receiver.scorebox.test=127.0.0.1",
    },
    checks_signatures=True,
)


def test_the_option_is_off_unless_asked(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("WEBHOOKS", raising=False)
    assert parse_args(["run"]).webhooks_local is False
    assert parse_args(["run", "--webhooks-local"]).webhooks_local is True
    monkeypatch.setenv("WEBHOOKS", "local")
    monkeypatch.setenv("WEBHOOK_RECEIVER_FAIL", "2")
    args = parse_args(["run"])
    assert (args.webhooks_local, args.webhook_fail) == (True, 2)


def _refused_in_one_line(
    argv: list[str], capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> str:
    """`parse_args(argv)`'s refusal: exit 2 and a single `error:` line on stderr."""
    monkeypatch.setenv("COLUMNS", "200")  # a usage block, if printed, on few lines
    with pytest.raises(SystemExit) as exited:
        parse_args(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert err.count("\n") == 1, err  # argparse's usage block came first (found in review)
    return err


def test_an_unknown_webhooks_mode_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A mistyped mode is refused, not ignored: the run would start without the receiver."""
    monkeypatch.setenv("WEBHOOKS", "public")

    err = _refused_in_one_line(["run"], capsys, monkeypatch)

    assert "WEBHOOKS='public' is not a mode: set WEBHOOKS=local" in err


@pytest.mark.parametrize("fail", ["two", "1.5", "-1"])
def test_a_receiver_fail_count_that_is_no_count_is_refused_in_one_line_with_the_receiver(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], fail: str
) -> None:
    """`int()` of it raised a ValueError traceback while argparse's defaults were built."""
    monkeypatch.setenv("WEBHOOKS", "local")
    monkeypatch.setenv("WEBHOOK_RECEIVER_FAIL", fail)

    err = _refused_in_one_line(["run"], capsys, monkeypatch)

    assert f"WEBHOOK_RECEIVER_FAIL={fail!r}" in err


def test_a_receiver_fail_count_is_ignored_without_the_receiver(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The variable means nothing without a local receiver: whatever it holds, the run starts
    (it raised a traceback with WEBHOOKS unset)."""
    monkeypatch.delenv("WEBHOOKS", raising=False)
    monkeypatch.setenv("WEBHOOK_RECEIVER_FAIL", "two")

    args = parse_args(["run"])

    assert (args.webhooks_local, args.webhook_fail) == (False, 0)
    monkeypatch.setenv("WEBHOOK_RECEIVER_FAIL", "")
    assert parse_args(["run", "--webhooks-local"]).webhook_fail == 0
    assert parse_args(["run", "--webhooks-local", "--webhook-fail", "3"]).webhook_fail == 3


def test_a_negative_fail_option_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv("WEBHOOKS", raising=False)

    err = _refused_in_one_line(
        ["run", "--webhooks-local", "--webhook-fail", "-1"], capsys, monkeypatch
    )

    assert "--webhook-fail must be 0 or more" in err


def test_the_receivers_settings_join_those_given_and_replace_the_ca() -> None:
    given = {"WEBHOOK_ALLOWED_TEST_HOSTS": "hooks.example.test", "WEBHOOK_CA_FILE": "/mine.pem"}

    env = with_receiver_env({"BOOTSTRAP_API_KEY": "k"}, RECEIVER, environ=given)

    assert env == {
        "BOOTSTRAP_API_KEY": "k",
        "WEBHOOK_CA_FILE": "/tmp/run/ca.pem",
        "WEBHOOK_ALLOWED_TEST_HOSTS": "hooks.example.test,receiver.scorebox.test",
        "WEBHOOK_TEST_HOST_ADDRESSES": "receiver.scorebox.test=127.0.0.1",
    }


def test_the_gateway_url_is_known_before_start_only_for_a_fixed_port() -> None:
    assert gateway_url_before_start("127.0.0.1", 8100) == "http://127.0.0.1:8100"
    assert gateway_url_before_start("0.0.0.0", 8100) == "http://127.0.0.1:8100"
    assert gateway_url_before_start("::1", 8100) == "http://[::1]:8100"
    assert gateway_url_before_start("127.0.0.1", 0) is None


def test_the_receiver_runs_logs_to_the_run_and_stops_with_it(tmp_path: Path) -> None:
    with local_webhook_receiver(tmp_path, gateway_url=None, api_key="", fail=1) as receiver:
        assert receiver.url.startswith("https://receiver.scorebox.test:")
        assert receiver.log_path == tmp_path / "webhook-receiver.log"
        ca_file = Path(receiver.notifier_env["WEBHOOK_CA_FILE"])
        assert ca_file.read_text().startswith("-----BEGIN CERTIFICATE-----")
        assert receiver.notifier_env["WEBHOOK_TEST_HOST_ADDRESSES"] == (
            "receiver.scorebox.test=127.0.0.1"
        )
        os.kill(receiver.pid, 0)  # running
    assert not ca_file.exists()  # its folder goes with the run
    with pytest.raises(ProcessLookupError):  # stopped (and waited for)
        os.kill(receiver.pid, 0)
    assert "answering 500 to the first 1, then 200" in receiver.log_path.read_text()


@pytest.mark.parametrize(
    ("replicas", "said"), [("two", "is not a whole number"), ("0", "1 or more")]
)
def test_a_scorer_count_that_is_no_count_is_refused_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], replicas: str, said: str
) -> None:
    """SCORER_REPLICAS=two raised a ValueError traceback while the defaults were built, and 0
    one from deep in the stack's start (a review)."""
    monkeypatch.delenv("WEBHOOKS", raising=False)
    monkeypatch.setenv("SCORER_REPLICAS", replicas)

    err = _refused_in_one_line(["run"], capsys, monkeypatch)

    assert f"SCORER_REPLICAS={replicas!r} " in err
    assert said in err


def test_the_scorer_count_comes_from_its_option_then_its_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("WEBHOOKS", raising=False)
    monkeypatch.delenv("SCORER_REPLICAS", raising=False)
    assert parse_args(["run"]).scorers == 1
    monkeypatch.setenv("SCORER_REPLICAS", "3")
    assert parse_args(["run"]).scorers == 3
    assert parse_args(["run", "--scorers", "2"]).scorers == 2
