"""Server mode with two training processes (gloo): a real `grpo serve-rollout` app on 127.0.0.1 (served from this
process, so it can count what reaches its engine) receives exactly one weight push and one verification probe per
sync, while both ranks generate their own prompts."""

from __future__ import annotations

import json
import subprocess
import sys
from collections import Counter

import pytest
from dist_env import clean_env, free_port
from served_app import app_in_thread

from grpo_cli.server.app import create_app
from grpo_cli.server.engines import ServeOptions, build
from grpo_cli.models.tiny import resolve_model_path


def counted(served) -> dict:
    """Wrap the served engine's update_weights/score/generate to count calls (pushes by version)."""
    engine, counts = served.engine, {"pushes": Counter(), "score": 0, "generate": 0}
    update, score, generate = engine.update_weights, engine.score, engine.generate

    def update_weights(named_tensors, version):
        counts["pushes"][version] += 1
        return update(named_tensors, version)

    def counted_score(seqs):
        counts["score"] += 1
        return score(seqs)

    def counted_generate(*args, **kw):
        counts["generate"] += 1
        return generate(*args, **kw)

    engine.update_weights, engine.score, engine.generate = update_weights, counted_score, counted_generate
    return counts


@pytest.mark.parametrize("transport", ["http", pytest.param("shm", marks=pytest.mark.slow)])  # ~12 s each
def test_two_ranks_push_once_per_sync(tmp_path, transport):
    served = build(ServeOptions(engine="hf", model=resolve_model_path("builtin:tiny")))
    counts = counted(served)
    run = tmp_path / "run"
    with app_in_thread(create_app(served)) as url:
        out = subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
             "--master_addr=127.0.0.1", "-m", "grpo_cli", "train", "--preset", "tiny-cpu-server",
             "--output-dir", str(run), "--set", f'rollout.server.urls=["{url}"]', "--set", "train.steps=2",
             "--set", f"rollout.server.weight_transport={transport}", "--set", "logging.progress=plain"],
            capture_output=True, text=True, timeout=300, env=clean_env(OMP_NUM_THREADS="1"), cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert json.loads((run / "summary.json").read_text())["world_size"] == 2
    assert counts["pushes"] == {1: 1, 2: 1}  # one push per sync, not one per rank
    assert counts["score"] == 2  # the verification probe: rank 0 only
    assert counts["generate"] >= 2 * 2 + 2  # both ranks' rollouts each step, and both ranks' final evaluation
