"""Async mode with a vision-language model: `grpo train --preset tiny-cpu-async` on the built-in tiny VLM and
`builtin:shapes` image prompts, on a local Ray cluster. Each prompt's images travel with it to the hf rollout actor
that generates it; the start-up sync to the actor is verified with a probe that carries an image; every later sync
leaves the frozen vision tower out."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow  # Ray starts: ~40-60 s with the machine loaded
def test_async_vlm_run_sends_images_to_the_actors(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT")}
    sets = ["model.name_or_path=builtin:tiny-vlm", "data.source=builtin:shapes", "train.steps=3",
            "train.prompts_per_step=2", "train.generations_per_prompt=2", "train.micro_batch_size=4",
            "rollout.max_completion_length=4", "eval.every_steps=0", "logging.progress=plain"]
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu-async", "--output-dir",
                          str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))],
                         capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    assert "hold weight version 0 (verified: probe logprob diff" in out.stdout, out.stdout[-2000:]
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[0]["staleness"] == 0
    assert all(r["sync/skipped_tensors"] > 0 for r in rows)  # the start-up sync sent the vision tower
    assert all(r["async/actor_generate_s"] > 0 for r in rows)
