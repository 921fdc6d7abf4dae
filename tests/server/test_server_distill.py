"""A served distillation teacher: `grpo serve-rollout` scores the student's samples through /score. With the
student's own checkpoint behind the server, the first step's reverse KL is 0 up to float rounding (the served
logprobs line up token for token with the trainer's; one position off would give a KL of several nats)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_served_teacher_scores_the_students_tokens(server_process, tiny_checkpoint, tmp_path):
    server = server_process()
    sets = [f"model.name_or_path={tiny_checkpoint}", f"algorithm.distill.teacher={server.url}", "train.steps=2",
            "train.prompts_per_step=2", "train.micro_batch_size=16", "eval.every_steps=0"]
    out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "--output-dir", str(tmp_path / "run"),
                          *[x for s in sets for x in ("--set", s)]], capture_output=True, text=True, timeout=300,
                         cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[0]["distill/reverse_kl"]) < 1e-5, rows[0]
    assert rows[0]["distill/teacher_logprob"] < -1.0  # real logprobs of a near-uniform model, not zeros
    assert rows[1]["distill/reverse_kl"] != 0.0  # the student moved, the served teacher did not


@pytest.mark.slow
def test_served_teacher_of_another_tokenizer_is_refused(server_process, tiny_checkpoint, tmp_path):
    from transformers import AutoTokenizer

    from grpo_cli.config.errors import UserError
    from grpo_cli.config.load import build_config
    from grpo_cli.models.tiny import build_tiny_checkpoint
    from grpo_cli.train.distill import served_teacher

    server = server_process(model=str(build_tiny_checkpoint(tmp_path / "chars", chars=True)))
    cfg = build_config("tiny-cpu", overrides=[f"algorithm.distill.teacher={server.url}"])
    with pytest.raises(UserError, match="does not share the policy's tokenizer") as err:
        served_teacher(cfg, tiny_checkpoint, AutoTokenizer.from_pretrained(tiny_checkpoint))
    assert server.url in str(err.value) and tiny_checkpoint in str(err.value)
