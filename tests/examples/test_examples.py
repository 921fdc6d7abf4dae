"""Every folder of examples/ runs on CPU at small sizes: training examples for a few steps, the multi-node one at
syntax + `--dry-run` level, the CI gate for real (a passing and a failing bound)."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from dist_env import free_port

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"


def _env(tmp_path: Path, **extra: str) -> dict:
    bin_dir = str(Path(sys.executable).parent)
    return {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "PYTHONUNBUFFERED": "1",
            **extra}


def _run(cmd: list[str], cwd: Path, env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def test_every_example_has_a_readme_and_is_listed_in_the_main_readme():
    readme = (EXAMPLES.parent / "README.md").read_text()
    folders = sorted(p for p in EXAMPLES.iterdir() if p.is_dir())
    assert len(folders) >= 6
    for folder in folders:
        assert (folder / "README.md").read_text().startswith("# "), folder
        assert f"](examples/{folder.name}/)" in readme, f"README does not link examples/{folder.name}/"


def test_scripts_parse():
    scripts = sorted([*EXAMPLES.glob("*/*.sh"), *EXAMPLES.glob("*/*.sbatch")])
    assert len(scripts) >= 6
    for script in scripts:
        out = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert out.returncode == 0, (script, out.stderr)


def _train_example(folder: str, steps: int, tmp_path: Path) -> tuple[Path, list[dict]]:
    """`grpo train --config config.yaml` run in the example's folder for `steps` steps: its run dir and metrics."""
    run = tmp_path / "run"
    out = _run(["grpo", "train", "--config", "config.yaml", "--output-dir", str(run), "--set", f"train.steps={steps}",
                "--set", "logging.progress=plain"], EXAMPLES / folder, _env(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    return run, _metrics(run)


@pytest.mark.slow
def test_gsm8k_math(tmp_path):
    run, rows = _train_example("01-gsm8k-math", 2, tmp_path)
    assert len(rows) == 2 and all(0.0 <= r["reward/math/mean"] <= 1.0 for r in rows), rows
    ev = rows[-1]  # eval.jsonl after the last step; pass@1 is the share of completions scored 1 by `math`
    assert ev["eval/pass@1"] == pytest.approx(ev["eval/reward/math/mean"]) and "eval/pass@4" in ev, ev
    sample = json.loads((run / "completions.jsonl").read_text().splitlines()[0])
    assert sample["prompt"].startswith("<system> Solve the problem.") and "<user>" in sample["prompt"]  # chat template


@pytest.mark.slow
def test_custom_reward_with_columns(tmp_path):
    _, rows = _train_example("02-custom-reward", 3, tmp_path)
    assert {k for k in rows[0] if k.startswith("reward/") and k.count("/") == 2} == {
        "reward/on_topic/mean", "reward/within_budget/mean", "reward/topic_per_step/mean"}
    assert all(0 <= r["reward/on_topic/mean"] <= 1 and r["reward/within_budget/mean"] <= 0 for r in rows)
    assert all(0 <= r["reward/topic_per_step/mean"] <= 1 for r in rows)


@pytest.mark.slow
def test_server_mode_script(tmp_path):
    out_dir = tmp_path / "run"
    out = _run(["bash", str(EXAMPLES / "03-server-mode" / "run.sh"), "--set", "logging.progress=plain"], tmp_path,
               _env(tmp_path, PORT=str(free_port()), STEPS="2", OUT=str(out_dir)))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "rollout server up at" in out.stdout
    assert len(_metrics(out_dir)) == 2
    assert "listening on" in (out_dir / "server.log").read_text()


@pytest.mark.slow
def test_ray_async_on_a_started_cluster(tmp_path):
    """`ray start --head` (127.0.0.1, a free port, 2 CPUs, its own temp dir); the example joins it through
    `rollout.ray.address: auto` (RAY_ADDRESS names this head, not any other cluster on the machine; its own auth
    token, not the shared ~/.ray/auth_token that other local clusters rewrite)."""
    import secrets
    import tempfile

    port, temp_dir = free_port(), tempfile.mkdtemp(prefix="ray-ex-", dir="/tmp")
    env = _env(tmp_path, RAY_ADDRESS=f"127.0.0.1:{port}", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16))
    head = subprocess.Popen(["ray", "start", "--head", "--block", "--node-ip-address", "127.0.0.1", "--port", str(port),
                             "--num-cpus", "2", "--include-dashboard", "false", "--disable-usage-stats",
                             "--temp-dir", temp_dir], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    try:
        out = _run(["bash", str(EXAMPLES / "04-ray-async" / "train.sh"), "--set", "logging.progress=plain"], tmp_path,
                   {**env, "STEPS": "3", "OUT": str(tmp_path / "run")})
        assert out.returncode == 0, out.stdout + out.stderr
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
    rows = _metrics(tmp_path / "run")
    assert [r["staleness"] for r in rows] == [0, 1, 1]


def test_multi_node_dry_run(tmp_path):
    """The committed sbatch is the preset's rendering (not hand-written); the torchrun recipe's launch command."""
    from grpo_cli.config.load import build_config
    from grpo_cli.launch.deploy_slurm import render_slurm

    sbatch = (EXAMPLES / "05-multi-node" / "grpo.sbatch").read_text()
    assert sbatch == render_slurm(build_config("qwen-7b-disagg-2x8")), (
        "regenerate: grpo train --preset qwen-7b-disagg-2x8 --dry-run --write-script examples/05-multi-node/grpo.sbatch")
    env = _env(tmp_path, DRY_RUN="1")
    torchrun = _run(["bash", str(EXAMPLES / "05-multi-node" / "torchrun-node.sh"), "1", "10.0.0.1"], tmp_path, env)
    assert torchrun.returncode == 0, torchrun.stderr
    launch = torchrun.stdout.split("# launch command\n")[1]
    assert "torch.distributed.run --nproc_per_node=8 --nnodes=2 --node_rank=1 --master_addr=10.0.0.1" in launch


@pytest.mark.slow
def test_mismatch_gate(tmp_path):
    """hf engine vs trainer on CPU: k3_kl is within 1e-3 (that gate passes); ESS cannot exceed 1 (that gate fails,
    exit 1). The workflow snippet is valid YAML that runs the same script."""
    import yaml

    report = tmp_path / "mismatch.json"
    out = _run(["bash", str(EXAMPLES / "06-mismatch-gate" / "gate.sh"), "-n", "2"], tmp_path,
               _env(tmp_path, ESS_MIN="1.01", REPORT=str(report)))
    assert out.returncode == 1, out.stdout + out.stderr
    gates = {g["metric"]: g["failed"] for g in json.loads(report.read_text())["gates"]}
    assert gates == {"k3_kl": False, "ess": True}, gates
    workflow = yaml.safe_load((EXAMPLES / "06-mismatch-gate" / "github-actions.yml").read_text())
    steps = workflow["jobs"]["mismatch"]["steps"]
    assert any("examples/06-mismatch-gate/gate.sh" in s.get("run", "") for s in steps)


def test_72b_recipe_plan_and_rehearsal_notes(tmp_path):
    """The annotated `grpo plan` block of examples/72b-recipe is what the command prints today, and the rehearsal's
    notes (dry run: the CPU config and its changes, nothing trained) name the changes the README describes. The
    rehearsal itself runs in tests/e2e/test_rehearse.py."""
    env = _env(tmp_path)
    plan = _run([sys.executable, "-m", "grpo_cli", "plan", "qwen-72b-colocate", "--gpu-mem", "80GiB", "--host-mem",
                 "2TB"], tmp_path, env)
    assert plan.returncode == 0, plan.stderr
    readme = (EXAMPLES / "72b-recipe" / "README.md").read_text()
    block = readme.split("```\n# batch plan")[1].split("```")[0]
    for line in ("# batch plan" + block).splitlines():
        shown = line.split("<-")[0].rstrip()
        if shown:
            assert shown in plan.stdout, f"README line not in `grpo plan` output: {shown!r}"
    notes = _run([sys.executable, "-m", "grpo_cli", "train", "--preset", "qwen-72b-colocate", "--rehearse",
                  "--dry-run"], tmp_path, env)
    assert notes.returncode == 0, notes.stderr
    assert "tensor_parallel_size 8 → 2" in notes.stdout and "builtin:tiny" in notes.stdout
    assert "grpo train --preset qwen-72b-colocate --rehearse" in readme


@pytest.mark.slow
def test_tool_calling(tmp_path):
    """The tool-calling example with a parser that reads every finished turn as a `lookup` call (a random-init
    model rarely writes one): its tools run in fresh processes, an error comes back as a message, turns go on."""
    run = tmp_path / "run"
    out = _run(["grpo", "train", "--config", "config.yaml", "--output-dir", str(run), "--set", "train.steps=2",
                "--set", "logging.progress=plain", "--set",
                f"agent.tool_parser={Path(__file__).parent / 'lookup_parser.py'}:every_turn_looks_up"],
               EXAMPLES / "07-tool-calling", _env(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _metrics(run)
    assert len(rows) == 2 and sum(r["tools/calls_per_rollout"] for r in rows) > 0
    assert sum(r["tools/errors"] for r in rows) > 0  # lookup("blue") raises: the model reads the error
    messages = [json.loads(line)["messages"] for line in (run / "completions.jsonl").read_text().splitlines()]
    results = {m["content"] for ms in messages for m in ms if m["role"] == "tool"}
    assert "3" in results and any("is not a number word" in r for r in results), results


@pytest.mark.slow
def test_code_reward(tmp_path):
    run, rows = _train_example("09-code-reward", 2, tmp_path)
    assert len(rows) == 2 and all(r["reward/code_tests/mean"] == 0.0 for r in rows), rows  # the tiny model's "code"
    assert all("reward/length/mean" in r for r in rows)


@pytest.mark.slow
def test_reward_model(tmp_path):
    out = _run(["bash", str(EXAMPLES / "08-reward-model" / "run.sh"), "--output-dir", str(tmp_path / "run"),
                "--set", "train.steps=2", "--set", "logging.progress=plain"], tmp_path, _env(tmp_path))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _metrics(tmp_path / "run")
    assert len(rows) == 2 and all(math.isfinite(r["reward/rm/mean"]) for r in rows), rows


@pytest.mark.slow
def test_judge_served_by_serve_rollout(tmp_path):
    """Three steps whose reward is a generative judge served by `grpo serve-rollout` (the tiny model behind a
    bearer token, `api: grpo`): every step and the evaluation after the last ask it (no failed request) and log
    its score and counts."""
    out_dir = tmp_path / "out"
    out = _run(["bash", str(EXAMPLES / "11-judge" / "run.sh"), "--output-dir", str(tmp_path / "run"),
                "--set", "train.steps=3", "--set", "train.prompts_per_step=4", "--set",
                "train.generations_per_prompt=4", "--set", "train.micro_batch_size=16", "--set",
                "eval.every_steps=3", "--set", "eval.num_prompts=2", "--set", "eval.generations_per_prompt=2",
                "--set", "logging.progress=plain"], tmp_path, _env(tmp_path, OUT=str(out_dir)))
    assert out.returncode == 0, out.stdout + out.stderr
    rows = _metrics(tmp_path / "run")
    assert len(rows) == 3, rows
    for r in rows:  # 16 completions a step, one /generate request of batch_size 16 (fewer when some repeat)
        assert r["judge/judge/requests"] == 1 and r["judge/judge/failed_requests"] == 0, r
        assert r["judge/judge/missing"] < 16 and 0 <= r["reward/judge/mean"] <= 1, r
    assert rows[-1]["eval/judge/judge/requests"] == 1 and rows[-1]["eval/judge/judge/failed_requests"] == 0
    assert "listening on" in (out_dir / "judge.log").read_text()


@pytest.mark.slow
def test_vision(tmp_path, monkeypatch):
    """Three hf steps of the tiny VLM on the example's rows (image files, an `images` column and a data URL); the
    exported model keeps its image processor, so `grpo eval` runs it on the same rows."""
    from grpo_cli.eval.command import run_eval

    run, rows = _train_example("12-vision", 3, tmp_path)
    assert len(rows) == 3 and all(0 <= r["reward/exact_match/mean"] <= 1 for r in rows), rows
    samples = [json.loads(line) for line in (run / "completions.jsonl").read_text().splitlines()]
    assert all(s["prompt"].count("<|image_pad|>") == 1 for s in samples)  # the text rewards see: one placeholder
    assert (run / "final-model" / "preprocessor_config.json").is_file()
    monkeypatch.chdir(EXAMPLES / "12-vision")  # the rows' image paths are relative to it
    report = run_eval(run, data="data.jsonl", out=tmp_path / "eval.json", overrides=["eval.num_prompts=6"])
    assert report["num_prompts"] == 6 and 0 <= report["metrics"]["eval/reward/exact_match/mean"] <= 1
