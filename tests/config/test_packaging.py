"""pyproject lists every subpackage and ships presets inside the wheel."""

from __future__ import annotations

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_packages_list_covers_every_subpackage():
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    found = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "grpo_cli").rglob("__init__.py")}
    assert found | {"grpo_cli.presets"} == listed


def test_presets_are_package_data():
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert conf["package-dir"]["grpo_cli.presets"] == "presets"
    assert conf["package-data"]["grpo_cli.presets"] == ["*.yaml"]
