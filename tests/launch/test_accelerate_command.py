"""The accelerate command grpo builds passes every value accelerate would otherwise default and warn about
("The following values were not passed to `accelerate launch`..."), checked by accelerate's own validator."""

from __future__ import annotations

import logging

import pytest

from grpo_cli.config.load import build_config
from grpo_cli.launch.command import launch_command


@pytest.mark.parametrize("overrides", [
    ["distributed.num_processes=2"],
    ["distributed.num_processes=2", "distributed.num_machines=2", "distributed.machine_rank=1",
     "distributed.main_process_ip=10.0.0.1", "train.micro_batch_size=16"],
])
def test_accelerate_sees_no_missing_values(overrides, monkeypatch, tmp_path, caplog):
    launch = pytest.importorskip("accelerate.commands.launch")
    # No `accelerate config` file: the branch where accelerate fills in defaults and warns.
    monkeypatch.setattr(launch, "default_config_file", str(tmp_path / "none.yaml"))
    cmd = launch_command(build_config(overrides=overrides), ["train", "--dry-run"])
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    for flag in ("--num_processes", "--num_machines", "--mixed_precision", "--dynamo_backend", "--multi_gpu"):
        assert flag in cmd
    args = launch.launch_command_parser().parse_args(cmd[3:])
    assert args.module and args.training_script == "grpo_cli"
    with caplog.at_level(logging.WARNING, logger=launch.logger.name):
        launch._validate_launch_command(args)
    assert "were not passed" not in caplog.text
