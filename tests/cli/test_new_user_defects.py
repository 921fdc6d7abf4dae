"""What a new user tries first, through the CLI: a `--config` file of their own data with no preset, and a
`--set` sub-key under a single value (issue 28)."""

from __future__ import annotations

import yaml
from typer.testing import CliRunner

from grpo_cli.cli.main import app

runner = CliRunner()


def _resolved(output: str) -> dict:
    """The `# resolved config` YAML that `--dry-run` prints (up to the next `# ...` heading)."""
    text = output.split("# resolved config", 1)[1].split("\n# ", 1)[0]
    return yaml.safe_load(text.split("\n", 1)[1])


def test_a_config_file_of_own_data_without_a_preset_dry_runs(tmp_path):
    """No `--preset`, no `extends:`: the file starts from the default without its evaluation block, whose
    `eval.source: auto` (the built-in task's held-out split) would refuse any custom data source."""
    data = tmp_path / "train.jsonl"
    data.write_text('{"prompt": "2+2?", "answer": "4"}\n' * 8)
    user = tmp_path / "my.yaml"
    user.write_text(f"data: {{source: {data}}}\n")
    result = runner.invoke(app, ["train", "--config", str(user), "--dry-run"])
    assert result.exit_code == 0, result.output
    cfg = _resolved(result.output)
    assert cfg["data"]["source"] == str(data) and cfg["eval"]["every_steps"] == 0  # evaluation off
    bare = runner.invoke(app, ["train", "--dry-run"])  # bare `grpo train` keeps the default's evaluation
    assert bare.exit_code == 0 and _resolved(bare.output)["eval"]["every_steps"] > 0


def test_a_sub_key_under_a_single_value_in_a_config_file_is_named(tmp_path):
    """The same mistake in a file instead of `--set` (was `TypeError: unhashable type: 'dict'` through --set)."""
    user = tmp_path / "bad.yaml"
    user.write_text("algorithm: {loss: {x: 1.0e+309}}\n")
    result = runner.invoke(app, ["train", "--preset", "qwen-1.5b-server", "--config", str(user), "--dry-run"])
    assert result.exit_code == 2, result.output
    assert "algorithm.loss" in result.output and "Traceback" not in result.output
