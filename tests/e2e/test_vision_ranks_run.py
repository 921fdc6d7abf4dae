"""Issue 46's acceptance for images on some ranks only: `grpo train --preset tiny-cpu-vlm --nproc 2 --set
distributed.backend=fsdp2` (4 steps) against `grpo serve-rollout --engine hf --model builtin:tiny-vlm`, on chat-message
rows of which some carry an image and some do not, ordered so that in every step one rank's micro-batches have images
where the other's have none. Before the fix the first step failed with gloo's "Received data size doesn't match
expected size". tests/ranks/test_ranks_images.py covers the same paths (fsdp2, ZeRO-3, ddp) in one fast launch."""

from __future__ import annotations

import json
import random
import subprocess
import sys

import pytest
from dist_env import clean_env

from grpo_cli.data.tasks import draw_shapes

LAYOUT = "II TT" " TT II" " IT TI" " TT TT"
"""Each step's 4 prompts (rank 0's two, then rank 1's; `data.shuffle: false`): I with an image, T text only."""


def _rows(tmp_path) -> list[dict]:
    rows = []
    for i, kind in enumerate(LAYOUT.replace(" ", "")):
        if kind == "I":
            draw_shapes("red", 1 + i % 3, "circle", random.Random(i)).save(tmp_path / f"shape{i}.png")
            content = [{"type": "image", "image": f"shape{i}.png"}, {"type": "text", "text": "what colour are the "
                                                                                             "shapes ?"}]
            rows.append({"prompt": [{"role": "user", "content": content}], "answer": "red"})
        else:
            rows.append({"prompt": [{"role": "user", "content": "what colour is blue ?"}], "answer": "blue"})
    return rows


# a server and two trainer processes start (42 s at load ~10 on 2 cores); the default run covers the same paths in
# tests/ranks/test_ranks_images.py (fsdp2 with images on one rank only, every pass)
@pytest.mark.extended
def test_fsdp2_on_two_ranks_with_images_on_some_ranks_only(tmp_path):
    from grpo_cli.server.launch import wait_ready_line

    data = tmp_path / "mixed.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in _rows(tmp_path)))
    env = clean_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, "-m", "grpo_cli", "serve-rollout", "--engine", "hf", "--model",
                               "builtin:tiny-vlm", "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, cwd=tmp_path, env=env)
    lines: list[str] = []
    try:
        url = wait_ready_line(server, 120, lines.append)
        assert url is not None, "".join(lines)[-3000:]
        sets = ["distributed.backend=fsdp2", "train.steps=4", f"data.source={data}", "data.shuffle=false",
                "train.prompts_per_step=4", "train.generations_per_prompt=4", "train.micro_batch_size=4",
                "algorithm.kl.beta=0.04", "distributed.timeout_minutes=1", "logging.progress=plain",
                "rollout.mode=server", f'rollout.server.urls=["{url}"]']
        out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "--preset", "tiny-cpu-vlm", "--nproc", "2",
                              "--output-dir", str(tmp_path / "run"), *(a for s in sets for a in ("--set", s))],
                             capture_output=True, text=True, timeout=400, env=env, cwd=tmp_path, check=False)
    finally:
        server.kill()
        server.wait(10)
    assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    rows = [json.loads(r) for r in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["backend"] == "fsdp2", summary
