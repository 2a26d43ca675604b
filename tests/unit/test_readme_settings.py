"""Every environment variable a service reads is in the README's Configuration section."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest
from pydantic_settings import BaseSettings

SETTINGS_MODULES = (
    "shared.settings",
    "services.gateway.settings",
    "services.status.settings",
    "services.scorer.settings",
    "services.scorer.model.settings",
    "services.scheduler.settings",
    "services.notifier.settings",
)


def _variables() -> set[str]:
    found: set[str] = set()
    for name in SETTINGS_MODULES:
        module = importlib.import_module(name)
        for value in vars(module).values():
            if isinstance(value, type) and issubclass(value, BaseSettings):
                for field in value.model_fields.values():
                    if isinstance(field.validation_alias, str):
                        found.add(field.validation_alias)
    return found


@pytest.mark.parametrize("variable", sorted(_variables()))
def test_every_setting_is_documented(variable: str) -> None:
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    configuration = readme.split("## Configuration", 1)[1].split("\n## ", 1)[0]
    assert f"`{variable}`" in configuration, f"{variable} is missing from the README's table"
