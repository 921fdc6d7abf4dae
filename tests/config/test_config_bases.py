"""Where a config starts: `--preset`, the file's own `extends:`, or the default preset without its evaluation
block; a sub-key under a single value is refused by name."""

from __future__ import annotations

import pytest

from grpo_cli.config.load import ConfigError, build_config


@pytest.fixture
def custom_data(tmp_path):
    (tmp_path / "train.jsonl").write_text('{"prompt": "2+2?", "answer": "4"}\n' * 8)
    return tmp_path / "train.jsonl"


def test_a_file_without_a_preset_does_not_inherit_the_default_evaluation(tmp_path, custom_data):
    """The default's eval block evaluates its built-in task's held-out split (`eval.source: auto`), which a custom
    data source does not have: such a file used to be refused."""
    user = tmp_path / "my.yaml"
    user.write_text(f"data: {{source: {custom_data}}}\n")
    cfg = build_config(file=user)
    assert cfg.eval.every_steps == 0 and cfg.data.source == str(custom_data)
    assert cfg.model.name_or_path == "builtin:tiny"  # the rest of the default stays
    assert build_config().eval.every_steps == 10  # bare `grpo train` unchanged


def test_a_file_can_extend_a_preset_and_keeps_its_evaluation(tmp_path):
    user = tmp_path / "my.yaml"
    user.write_text("extends: tiny-cpu\ntrain: {steps: 7}\n")
    cfg = build_config(file=user)
    assert cfg.preset == "tiny-cpu" and cfg.train.steps == 7 and cfg.eval.every_steps == 10
    with pytest.raises(ConfigError, match="disagree"):
        build_config(preset="tiny-cpu-lora", file=user)


@pytest.mark.parametrize("override,field", [("algorithm.loss.x=1e309", "algorithm.loss"),
                                            ("train.steps.max=3", "train.steps"),
                                            ("model.lora.r.y=1", "model.lora.r")])
def test_a_sub_key_under_a_single_value_names_the_field(override, field):
    with pytest.raises(ConfigError, match=f"{field} is a single value"):
        build_config(overrides=[override])


def test_a_sub_key_of_a_section_still_merges():
    assert build_config(overrides=["model.lora.r=8"]).model.lora.r == 8
