"""README and docs/ stay true: the config reference (docs/configuration.md) matches the schema, README links every
docs page and every link resolves, README stays a front door (≤ 300 lines), CI runs README's test command."""

from __future__ import annotations

import re
from pathlib import Path

from grpo_cli.config.reference import BEGIN, END, TRANSPORTS_BEGIN, TRANSPORTS_END, reference_markdown, transport_table

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_is_current():
    page = (ROOT / "docs" / "configuration.md").read_text()
    assert page[page.index(BEGIN) : page.index(END) + len(END)] == reference_markdown(), (
        "regenerate with: python -m grpo_cli.config.reference --write"
    )


def test_weight_transport_table_is_generated_from_the_one_list():
    page = (ROOT / "docs" / "server-mode.md").read_text()
    assert page[page.index(TRANSPORTS_BEGIN) : page.index(TRANSPORTS_END) + len(TRANSPORTS_END)] == transport_table(), (
        "regenerate with: python -m grpo_cli.config.reference --write"
    )


def test_readme_is_a_front_door_that_links_every_docs_page():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md"))
    assert len(pages) >= 10
    assert [p for p in pages if f"](docs/{p})" not in readme] == []


def test_every_relative_link_in_readme_and_docs_resolves():
    broken = []
    for page in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", page.read_text()):
            if "://" not in target and not (page.parent / target).exists():
                broken.append(f"{page.name} → {target}")
    assert broken == []


def test_ci_runs_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```bash\n(.*?)\n```", readme, re.DOTALL)
    assert blocks[0].endswith("&& grpo train")
    test_cmd = blocks[1].strip()
    assert "pytest" in test_cmd
    assert test_cmd in (ROOT / ".ci" / "run").read_text().splitlines()


def test_readme_config_example_validates(tmp_path):
    from grpo_cli.config.load import build_config

    readme = (ROOT / "README.md").read_text()
    example = re.findall(r"```yaml\n(.*?)\n```", readme, re.DOTALL)[0]
    (tmp_path / "my.yaml").write_text(example)
    cfg = build_config(file=tmp_path / "my.yaml", overrides=["train.learning_rate=5e-7"])
    assert cfg.preset == "qwen-1.5b-colocate" and cfg.train.steps == 500
    assert cfg.rewards.functions[0].name == "my_rewards.py:exact_match"
