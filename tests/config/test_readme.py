"""README stays true: the config reference matches the schema; CI runs README's test command."""

from __future__ import annotations

import re
from pathlib import Path

from grpo_cli.config.reference import BEGIN, END, reference_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_is_current():
    readme = (ROOT / "README.md").read_text()
    assert readme[readme.index(BEGIN) : readme.index(END) + len(END)] == reference_markdown(), (
        "regenerate with: python -m grpo_cli.config.reference"
    )


def test_ci_runs_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)
    assert blocks[0].endswith("&& grpo train")
    test_cmd = blocks[1].strip()
    assert "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()
