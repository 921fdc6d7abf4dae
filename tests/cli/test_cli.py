"""The `grpo` command through Typer's CliRunner and real subprocesses: help, dry-run, errors, lazy imports."""

from __future__ import annotations

import subprocess
import sys

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app

runner = CliRunner()


def test_version_and_help():
    assert "grpo-cli" in runner.invoke(app, ["--version"]).output
    out = runner.invoke(app, ["--help"]).output
    for command in ("train", "plan", "presets", "config"):
        assert command in out


def test_presets_list_and_show():
    out = runner.invoke(app, ["presets", "list"]).output
    assert "tiny-cpu" in out and "qwen-72b-colocate" in out
    show = runner.invoke(app, ["presets", "show", "qwen-72b-colocate"])
    assert show.exit_code == 0
    assert "zero_stage: 3" in show.output and "# ZeRO stage." in show.output


@pytest.mark.parametrize("args,needle", [
    (["train", "--set", "train.learning_rate=abc"], "train.learning_rate"),
    (["train", "--set", "nope.x=1"], "nope: unknown key"),
    (["train", "--preset", "does-not-exist"], "unknown preset"),
    (["train", "--config", "/no/such/file.yaml"], "does not exist"),
    (["train", "--preset", "qwen-72b-colocate"], "needs 8 CUDA GPUs, found 0"),
    (["plan", "--gpu-mem", "lots"], "--gpu-mem 'lots' is not a size"),
    (["train", "--preset", "qwen-1.5b-server", "--set", "algorithm.loss.x=1e309", "--dry-run"],
     "algorithm.loss is a single value"),
    (["train", "--preset", "qwen-72b-colocate", "--set", "algorithm.loss.bogus=inf", "--dry-run"],
     "no sub-key 'bogus'"),
])
def test_user_errors_exit_2_with_one_paragraph(args, needle):
    result = runner.invoke(app, args)
    assert result.exit_code == 2, result.output
    assert needle in result.output
    assert "Traceback" not in result.output


def test_dry_run_72b_prints_config_plan_and_deepspeed_launch():
    result = runner.invoke(app, ["train", "--preset", "qwen-72b-colocate", "--dry-run"])
    assert result.exit_code == 0, result.output
    out = result.output
    assert "# resolved config" in out and "name_or_path: Qwen/Qwen2.5-Math-72B" in out
    assert "# batch plan" in out and "# memory per GPU" in out
    assert "accelerate.commands.launch --num_processes 8" in out and "--multi_gpu" in out
    assert "# DeepSpeed config" in out and '"stage": 3' in out
    assert '"offload_optimizer"' in out and '"overlap_comm": true' in out


@pytest.mark.parametrize("launcher,needles", [
    ("accelerate", ["--num_processes 4 --num_machines 2 --machine_rank 1 --main_process_ip 10.0.0.1 "
                    "--main_process_port 29501"]),
    ("torchrun", ["--nproc_per_node=2 --nnodes=2 --node_rank=1 --master_addr=10.0.0.1 --master_port=29501"]),
])
def test_multi_node_options_reach_the_launch_command(launcher, needles):
    result = runner.invoke(app, ["train", "--nproc", "2", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                                 "10.0.0.1", "--master-port", "29501", "--set", "train.micro_batch_size=16",
                                 "--set", f"distributed.launcher={launcher}", "--dry-run"])
    assert result.exit_code == 0, result.output
    for needle in needles:
        assert needle in result.output
    assert result.output.rstrip().endswith("--worker")


def test_multi_node_without_master_addr_is_refused():
    result = runner.invoke(app, ["train", "--nnodes", "2", "--set", "train.micro_batch_size=16"])
    assert result.exit_code == 2 and "needs distributed.main_process_ip" in result.output


def test_external_launch_overrides_follow_the_launcher_env():
    from grpo_cli.launch.command import external_launch

    assert external_launch({}) is None
    assert external_launch({"WORLD_SIZE": "2", "LOCAL_WORLD_SIZE": "2"}) == [
        "distributed.num_processes=2", "distributed.num_machines=1", "distributed.machine_rank=0"]
    assert external_launch({"WORLD_SIZE": "4", "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "MASTER_ADDR": "h0"}) == [
        "distributed.num_processes=2", "distributed.num_machines=2", "distributed.machine_rank=1",
        "distributed.main_process_ip=h0"]


def test_positional_and_option_preset_agree():
    assert runner.invoke(app, ["train", "tiny-cpu", "--preset", "tiny-cpu", "--dry-run"]).exit_code == 0
    result = runner.invoke(app, ["train", "tiny-cpu", "--preset", "tiny-cpu-vllm", "--dry-run"])
    assert result.exit_code == 2 and "two presets" in result.output


def test_config_validate(tmp_path):
    good = tmp_path / "good.yaml"
    good.write_text("train:\n  steps: 3\n")
    assert runner.invoke(app, ["config", "validate", str(good)]).exit_code == 0
    bad = tmp_path / "bad.yaml"
    bad.write_text("train:\n  steps: -1\n")
    result = runner.invoke(app, ["config", "validate", str(bad)])
    assert result.exit_code == 2 and "train.steps" in result.output
    broken = tmp_path / "broken.yaml"
    broken.write_text("train: [unclosed\n")
    result = runner.invoke(app, ["config", "validate", str(broken)])
    assert result.exit_code == 2 and "not valid YAML" in result.output


def test_help_and_dry_run_import_no_torch():
    code = (
        "import sys\n"
        "from typer.testing import CliRunner\n"
        "from grpo_cli.cli.main import app\n"
        "r = CliRunner()\n"
        "assert r.invoke(app, ['--help']).exit_code == 0\n"
        "res = r.invoke(app, ['train', '--preset', 'qwen-7b-colocate-tp2', '--dry-run'])\n"
        "assert res.exit_code == 0, res.output\n"
        "res = r.invoke(app, ['train', '--preset', 'qwen-7b-disagg-2x8', '--dry-run'])\n"
        "assert res.exit_code == 0 and '#SBATCH' in res.output, res.output\n"
        "heavy = [m for m in ('torch', 'transformers', 'vllm') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_module_dependency_direction():
    """DESIGN.md §2: nothing imports cli; algo imports only torch; ui is the only rich importer."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "grpo_cli"
    for path in root.rglob("*.py"):
        pkg = path.relative_to(root).parts[0]
        tree = ast.parse(path.read_text())
        names = [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        names += [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        if pkg != "cli" and path.name != "__main__.py":
            assert not any(m.startswith("grpo_cli.cli") for m in names), path
        if pkg != "ui":
            assert not any(m.split(".")[0] == "rich" for m in names), path
        if pkg == "algo":
            assert all(m.split(".")[0] in ("torch", "grpo_cli", "__future__", "typing", "collections", "math",
                                           "dataclasses") for m in names), (path, names)
