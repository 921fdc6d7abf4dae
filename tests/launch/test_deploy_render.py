"""`deployment:` rendered (pure functions: config → script text), its rules, the fleet's device split, the plan rows
and `grpo doctor --mode multi-node` (the two-node run itself: test_deploy_two_nodes.py)."""

from __future__ import annotations

import json
import subprocess

import pytest
from typer.testing import CliRunner

from grpo_cli.cli.main import app
from grpo_cli.config.errors import UserError
from grpo_cli.config.load import build_config
from grpo_cli.launch.deploy_ray import render_ray
from grpo_cli.launch.deploy_slurm import render_slurm
from grpo_cli.planner.plan import memory_plan, peak_bytes
from grpo_cli.planner.plan_deploy import deployment_lines, training_view
from grpo_cli.server.engines import ServeError, ServeOptions
from grpo_cli.server.fleet import child_argv, engine_devices, fleet_size

SLURM_TINY = ["rollout.mode=server", "deployment.scheduler=slurm", "deployment.rollout_nodes=1"]


def _parses(script: str, tmp_path) -> None:
    (tmp_path / "s.sh").write_text(script)
    assert subprocess.run(["bash", "-n", str(tmp_path / "s.sh")]).returncode == 0


def test_disaggregated_presets_render_one_sbatch(tmp_path):
    s7 = render_slurm(build_config("qwen-7b-disagg-2x8"))
    assert "#SBATCH --nodes=2" in s7 and "#SBATCH --gpus-per-node=8" in s7
    assert "grpo serve-rollout --engine vllm --model Qwen/Qwen2.5-7B-Instruct --host 0.0.0.0 --port 8000 " \
           "--data-parallel-size 8" in s7
    assert "for ((i = 0; i < 8; i++))" in s7 and 'curl -sf -o /dev/null "$url/health"' in s7
    assert "grpo train --config \"$GRPO_SHARED_DIR/config.yaml\" --nnodes 1" in s7
    # servers start in the background, trainers after; the servers are stopped when training ends
    assert s7.index("node.sh\" rollout &") < s7.index("node.sh\" train") < s7.index('kill "$servers"')
    s72 = render_slurm(build_config("qwen-72b-disagg-4x8"))
    assert "#SBATCH --nodes=4" in s72 and "--nnodes 2" in s72 and "for ((i = 0; i < 1; i++))" in s72
    assert "vllm serve Qwen/Qwen2.5-Math-72B --host 0.0.0.0 --port 8000 --data-parallel-size 2 " \
           "--tensor-parallel-size 4" in s72
    for script in (s7, s72):
        _parses(script, tmp_path)


def test_dry_run_prints_the_sbatch_and_a_real_run_points_at_it(tmp_path):
    out = tmp_path / "job.sbatch"
    res = CliRunner().invoke(app, ["train", "--preset", "qwen-7b-disagg-2x8", "--dry-run", "--write-script", str(out)])
    assert res.exit_code == 0, res.output
    assert "# deployment (slurm)" in res.output and "#SBATCH --nodes=2" in res.output
    assert out.read_text() == render_slurm(build_config("qwen-7b-disagg-2x8"))
    res = CliRunner().invoke(app, ["train", "--preset", "qwen-7b-disagg-2x8"])
    assert res.exit_code == 2 and "multi-node job" in res.output
    res = CliRunner().invoke(app, ["train", "--dry-run", "--write-script", str(out)])
    assert res.exit_code == 2 and "scheduler is 'none'" in res.output


def test_ray_bootstrap_shows_ray_only_the_rollout_gpus(tmp_path):
    base = ["rollout.mode=async", "deployment.scheduler=ray"]
    disagg = render_ray(build_config("tiny-cpu-async", None, [*base, "deployment.rollout_nodes=1"]))
    assert '--num-gpus=8 --block' in disagg and 'CUDA_VISIBLE_DEVICES="" ray start --head --port=6379 --num-gpus=0' \
        in disagg and "--set rollout.ray.address=auto" in disagg
    assert disagg.count("--num-cpus=0") == 2  # neither the head nor another training node offers cores
    assert 'RAY_AUTH_TOKEN_PATH="$GRPO_SHARED_DIR/ray/auth_token"' in disagg and "export RAY_AUTH_MODE=token" in disagg
    shared = render_ray(build_config("tiny-cpu-async", None, [
        *base, "distributed.num_processes=2", "rollout.ray.num_actors=2", "distributed.rollout_gpus=2"]))
    assert 'CUDA_VISIBLE_DEVICES="2,3" ray start --head --port=6379 --num-gpus=2' in shared
    assert "--num-cpus" not in shared  # no rollout nodes: the actors take the training node's cores
    for script in (disagg, shared):
        _parses(script, tmp_path)


@pytest.mark.parametrize(("overrides", "words"), [
    (["deployment.rollout_nodes=1"], "needs a script to start them"),
    (["deployment.scheduler=slurm", "deployment.rollout_nodes=1"], "rollout.mode must be 'server'"),
    ([*SLURM_TINY, "deployment.gpus_per_node=2", "deployment.rollout_tensor_parallel=2"], "one GPU per engine"),
    ([*SLURM_TINY, "deployment.rollout_tensor_parallel=3"], "must divide deployment.gpus_per_node"),
    ([*SLURM_TINY, "rollout.server.weight_transport=shm"], "one host only"),
    ([*SLURM_TINY, "deployment.rollout_layout=data_parallel"], "needs rollout.engine=vllm-serve"),
    (["deployment.scheduler=ray"], "rollout.mode=async"),
    (["rollout.mode=async", "deployment.scheduler=ray", "deployment.rollout_nodes=1", "deployment.gpus_per_node=1",
      "rollout.ray.num_actors=2"], "give Ray 1"),
    (["deployment.scheduler=slurm", "deployment.gpus_per_node=1", "distributed.num_processes=2"], "exceeds deployment.gpus_per_node"),
])
def test_rules_refuse_a_deployment_that_cannot_run(overrides, words):
    with pytest.raises(UserError, match=words):
        build_config("tiny-cpu", None, overrides)


def test_typed_urls_are_refused_where_they_are_derived():
    cfg = build_config("tiny-cpu", None, [*SLURM_TINY, 'rollout.server.urls=["http://h:1"]'])
    with pytest.raises(UserError, match="derived from the rollout nodes"):
        render_slurm(cfg)


def test_fleet_splits_gpus_by_tensor_parallel_group_and_refuses_all_gpus_on_cpu():
    assert [engine_devices(i, 2, 8) for i in range(4)] == ["0,1", "2,3", "4,5", "6,7"]
    assert engine_devices(1, 1, 0) is None  # CPU engines: no CUDA_VISIBLE_DEVICES
    assert fleet_size(None, True, 2, 8) == 4 and fleet_size(2, False, 1, 0) == 2
    with pytest.raises(ServeError, match="no CUDA GPU"):
        fleet_size(None, True, 1, 0)
    with pytest.raises(ServeError, match="needs 6 GPUs"):
        fleet_size(3, False, 2, 4)
    argv = child_argv(ServeOptions(engine="hf", model="/m", port=1, token="secret"), 8001, "TOK")
    assert argv[argv.index("--port") + 1] == "8001" and "secret" not in argv and "--no-compile" in argv
    res = CliRunner().invoke(app, ["serve-rollout", "--model", "builtin:tiny", "--data-parallel-size", "2",
                                   "--port", "0"])
    assert res.exit_code == 2 and "fixed --port" in res.output


def test_plan_rows_per_node_group_count_the_real_training_nodes():
    cfg = build_config("qwen-72b-disagg-4x8")
    lines = "\n".join(deployment_lines(cfg, 80 * 2**30))
    assert "training nodes               2 x 8 process(es)" in lines and "2 URL(s)" in lines and "kv_cache" in lines
    one_node = peak_bytes(cfg, memory_plan(cfg, 80 * 2**30))
    assert peak_bytes(cfg, memory_plan(training_view(cfg), 80 * 2**30)) < one_node  # ZeRO-3 over 16, not 8


def test_doctor_multi_node_compares_manifests(tmp_path):
    runner = CliRunner()
    for node in ("train-0", "rollout-0"):
        res = runner.invoke(app, ["doctor", "--mode", "multi-node", "--write-manifest",
                                  str(tmp_path / "manifests" / f"{node}.json"), "--model", "builtin:tiny"])
        assert res.exit_code == 0, res.output
    res = runner.invoke(app, ["doctor", "--mode", "multi-node", "--shared-dir", str(tmp_path)])
    assert res.exit_code == 0 and "2 nodes agree" in res.output and "GLOO_SOCKET_IFNAME" in res.output
    other = json.loads((tmp_path / "manifests" / "rollout-0.json").read_text()) | {"grpo_cli": "0.0.1"}
    (tmp_path / "manifests" / "rollout-0.json").write_text(json.dumps(other))
    res = runner.invoke(app, ["doctor", "--mode", "multi-node", "--shared-dir", str(tmp_path)])
    assert res.exit_code == 1 and "grpo_cli differs" in res.output
