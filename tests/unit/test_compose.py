"""`compose.yaml` and the image: valid for Compose, and shaped the way DESIGN.md asks.

Validation uses `docker compose config` (the plugin) or `docker-compose config` (Debian's
`docker-compose` package); neither needs a Docker engine. Structure is read with PyYAML.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
COMPOSE_FILE = ROOT / "compose.yaml"
DOCKERFILE = ROOT / "deploy" / "Dockerfile"
APP_SERVICES = ("gateway", "status", "scorer", "scheduler", "notifier")
INFRA_SERVICES = ("rabbitmq", "mongo")
HOW_TO_INSTALL = (
    "no Compose command: install Debian's `docker-compose` "
    "(apt-get install -y --no-install-recommends docker-compose) "
    "or the Docker Compose plugin (`docker compose`)"
)


def compose_command() -> list[str] | None:
    """`docker compose` when the plugin answers, else `docker-compose`, else None."""
    if shutil.which("docker"):
        probe = subprocess.run(
            ["docker", "compose", "version"],
            capture_output=True,
            text=True,
            timeout=30,
            check=False,
        )
        if probe.returncode == 0:
            return ["docker", "compose"]
    if shutil.which("docker-compose"):
        return ["docker-compose"]
    return None


def clean_env() -> dict[str, str]:
    """The environment minus variables the compose file interpolates, for stable output,
    but the internal key it requires."""
    interpolated = ("GATEWAY_PORT", "LOG_LEVEL", "LLM_", "SCOREBOX_", "COMPOSE_")
    kept = {k: v for k, v in os.environ.items() if not k.startswith(interpolated)}
    return {**kept, "SCOREBOX_INTERNAL_KEY": "compose-test-internal-key"}


def compose_config(
    *args: str, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    """`compose config` of the file, in `env` (`clean_env()` when None)."""
    command = compose_command()
    if command is None:
        pytest.skip(HOW_TO_INSTALL)
    return subprocess.run(
        [*command, "-f", str(COMPOSE_FILE), "config", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=ROOT,
        env=clean_env() if env is None else env,
        check=False,
    )


@pytest.fixture(scope="module")
def compose() -> dict[str, Any]:
    """compose.yaml as Compose resolves it (anchors and merge keys applied)."""
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read compose.yaml")
    data: dict[str, Any] = yaml.safe_load(COMPOSE_FILE.read_text())
    return data


def services(compose: dict[str, Any]) -> dict[str, Any]:
    found: dict[str, Any] = compose["services"]
    return found


def test_compose_accepts_the_file() -> None:
    result = compose_config("-q")

    assert result.returncode == 0, result.stderr


def test_compose_resolves_the_llm_provider_default() -> None:
    yaml = pytest.importorskip("yaml", reason="PyYAML is needed to read the resolved configuration")
    result = compose_config()
    assert result.returncode == 0, result.stderr
    resolved = yaml.safe_load(result.stdout)["services"]

    assert resolved["scorer"]["environment"]["LLM_PROVIDER"] == "heuristic"
    assert "8000" in str(resolved["gateway"]["ports"])


def test_the_four_services_and_both_infrastructure_services_are_defined(
    compose: dict[str, Any],
) -> None:
    assert set(services(compose)) == {*APP_SERVICES, *INFRA_SERVICES}


@pytest.mark.parametrize("name", [*APP_SERVICES, *INFRA_SERVICES])
def test_every_service_has_a_healthcheck_and_restarts(compose: dict[str, Any], name: str) -> None:
    service = services(compose)[name]

    assert service["healthcheck"]["test"]
    assert service["restart"] == "unless-stopped"


def test_the_scorer_scales_no_fixed_host_port_or_container_name(compose: dict[str, Any]) -> None:
    scorer = services(compose)["scorer"]

    assert "ports" not in scorer
    assert "container_name" not in scorer


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_wait_for_healthy_infrastructure(compose: dict[str, Any], name: str) -> None:
    depends_on = services(compose)[name]["depends_on"]

    for infra in INFRA_SERVICES:
        assert depends_on[infra]["condition"] == "service_healthy"


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_run_their_module_from_one_image(compose: dict[str, Any], name: str) -> None:
    service = services(compose)[name]

    assert service["command"] == ["python", "-m", f"services.{name}"]
    assert service["build"]["dockerfile"] == "deploy/Dockerfile"
    assert (ROOT / service["build"]["context"] / "deploy" / "Dockerfile").is_file()


@pytest.mark.parametrize("name", APP_SERVICES)
def test_app_services_get_the_infrastructure_env_of_the_design(
    compose: dict[str, Any], name: str
) -> None:
    env = services(compose)[name]["environment"]

    assert env["RABBITMQ_URL"] == "amqp://guest:guest@rabbitmq:5672/"
    assert env["MONGO_URL"] == "mongodb://mongo:27017"
    assert env["HTTP_HOST"] == "0.0.0.0"
    assert env["LLM_PROVIDER"] == "${LLM_PROVIDER:-heuristic}"
    assert env["HEALTHCHECK_URL"].endswith("/healthz")


@pytest.mark.parametrize("name", ["gateway", "status", "scheduler", "notifier"])
def test_the_services_of_the_internal_api_share_the_internal_key(
    compose: dict[str, Any], name: str
) -> None:
    """The gateway sends it; the others' internal routes (the scheduler's port is published,
    the notifier's serve the signing secrets) refuse a request without it. Required: unset,
    Compose stops rather than start them open (a review)."""
    env = services(compose)[name]["environment"]

    assert env["INTERNAL_API_KEY"].startswith("${SCOREBOX_INTERNAL_KEY:?")


@pytest.mark.parametrize("name", APP_SERVICES)
def test_every_service_takes_the_one_metrics_key(compose: dict[str, Any], name: str) -> None:
    """The scraper's key guards every service's /metrics; empty (METRICS_API_KEY unset), the
    gateway's takes the admin key only and the others' are open."""
    env = services(compose)[name]["environment"]

    assert env["METRICS_API_KEY"] == "${METRICS_API_KEY:-}"


def test_the_gateway_is_published_and_finds_the_status_service(compose: dict[str, Any]) -> None:
    gateway = services(compose)["gateway"]

    assert gateway["ports"] == ["${GATEWAY_PORT:-8000}:8000"]
    assert gateway["environment"]["STATUS_URL"] == "http://status:8001"
    assert gateway["depends_on"]["status"]["condition"] == "service_healthy"


def test_the_scorer_passes_the_llm_settings_through(compose: dict[str, Any]) -> None:
    env = services(compose)["scorer"]["environment"]

    for name in ("LLM_BASE_URL", "LLM_API_KEY", "LLM_MODEL", "LLM_TIMEOUT_S"):
        assert name in env


def test_rabbitmq_is_4x_with_management_and_our_config(compose: dict[str, Any]) -> None:
    rabbitmq = services(compose)["rabbitmq"]

    assert rabbitmq["image"].startswith("rabbitmq:4")
    assert rabbitmq["image"].endswith("-management")
    assert any("15672" in port for port in rabbitmq["ports"])
    mounted = [volume.split(":")[0] for volume in rabbitmq["volumes"]]
    for source in mounted:
        if source.startswith("./"):
            assert (ROOT / source).is_file(), source


def test_mongo_is_version_7(compose: dict[str, Any]) -> None:
    assert services(compose)["mongo"]["image"] == "mongo:7"


def test_the_image_runs_as_a_non_root_user_with_a_healthcheck() -> None:
    dockerfile = DOCKERFILE.read_text()

    assert "FROM python:3.13-slim" in dockerfile
    assert "\nUSER scorebox" in dockerfile
    assert "\nHEALTHCHECK " in dockerfile
    assert "/healthz" in dockerfile


def test_the_build_context_keeps_what_pip_install_needs() -> None:
    dockerignore = (ROOT / ".dockerignore").read_text().splitlines()

    for needed in ("!pyproject.toml", "!constraints.txt", "!README.md", "!shared", "!services"):
        assert needed in dockerignore


def test_the_image_installs_the_versions_the_tests_ran_with() -> None:
    """It installed the newest versions pyproject's ranges allow, never tested together."""
    assert "-c /tmp/constraints.txt" in DOCKERFILE.read_text()


def test_compose_stops_without_the_internal_key_and_says_which() -> None:
    without = {k: v for k, v in clean_env().items() if k != "SCOREBOX_INTERNAL_KEY"}
    result = compose_config("-q", env=without)

    assert result.returncode != 0
    assert "set SCOREBOX_INTERNAL_KEY to a random token" in result.stderr
