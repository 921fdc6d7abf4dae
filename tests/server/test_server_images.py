"""Images over `grpo serve-rollout` (hf engine on the built-in tiny VLM, served from a thread on 127.0.0.1; the
end-to-end run starts the real server in a subprocess): PNG data URLs that decode to the trainer's exact pixels,
sent once per prompt however many completions it gets; the server's completions, sampler logprobs and scores equal
the same engine's in this process; a text-only server refuses images; a 3-step run in server mode syncs the
frozen vision tower once, probes with an image and logs the rollout_correction/ mismatch of image rows."""

from __future__ import annotations

import dataclasses
import base64
import json
import subprocess
import sys

import pytest
import torch
from dist_env import clean_env
from served_app import app_in_thread, image_of

from grpo_cli.rollout import images as wire_images
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.remote.client import ServerEngine
from grpo_cli.rollout.seeds import request_seed
from grpo_cli.rollout.transport.http_client import Policy
from grpo_cli.server.app import create_app

FAST = Policy(connect_timeout_s=5, request_timeout_s=60, retries=0)


def test_data_urls_carry_exact_pixels_and_bad_ones_are_named():
    im = image_of(0, (30, 20))
    back = wire_images.decode(wire_images.encode([[im], []]), what="images")
    assert back[1] == [] and back[0][0].size == (30, 20) and back[0][0].tobytes() == im.tobytes()  # PNG: lossless
    with pytest.raises(ValueError, match=r"images\[0\]\[0\]: expected a data URL"):
        wire_images.decode([["http://example/x.png"]], what="images")
    with pytest.raises(ValueError, match=r"images\[0\]\[1\]: the image does not decode"):
        wire_images.decode([[wire_images.to_data_url(im), "data:image/png;base64," + base64.b64encode(b"no").decode()]],
                           what="images")
    with pytest.raises(ValueError, match=r"30x20 pixels is over the limit of 100"):
        wire_images.from_data_url(wire_images.to_data_url(im), where="x", max_pixels=100)


def test_server_generates_and_scores_with_images_sent_once_per_prompt(served_vlm):
    served, ids, images = served_vlm
    sampling = SamplingParams(n=3, max_tokens=4, seed=11)
    # the client seeds rank 0's request (`rollout/seeds.py`); the served engine then samples with that seed
    sent = dataclasses.replace(sampling, seed=request_seed(sampling.seed, rank=0, prompt=0))
    local = served.engine.generate(ids, sent, images=images)
    local_scores = served.engine.score([i + c for i, c in zip(ids, local.completion_ids[::3])], images=images)
    with app_in_thread(create_app(served)) as url:
        eng = ServerEngine([url], policy=FAST)
        bodies = []
        call = eng.http.call

        def recording(url, method, path, **kw):
            bodies.append((path, kw.get("json")))
            return call(url, method, path, **kw)

        eng.http.call = recording
        try:
            assert eng.accepts_images
            batch = eng.generate(ids, sampling, images=images)
            scores = eng.score([i + c for i, c in zip(ids, batch.completion_ids[::3])], images=images)
        finally:
            eng.close()
    assert batch.completion_ids == local.completion_ids and batch.finish_reasons == local.finish_reasons
    assert torch.allclose(torch.tensor(batch.sampler_logprobs), torch.tensor(local.sampler_logprobs), atol=1e-6)
    assert max(abs(a - b) for s, t in zip(scores, local_scores) for a, b in zip(s, t)) <= 1e-6
    (_, gen), (_, sc) = [(p, b) for p, b in bodies if p in ("/generate", "/score")]
    assert len(gen["images"]) == len(ids) == 2 and [len(r) for r in gen["images"]] == [1, 1]  # not × n
    assert gen["sampling"]["n"] == 3 and len(sc["images"]) == 2


def test_a_text_only_server_refuses_images(served_tiny):
    import httpx

    with app_in_thread(create_app(served_tiny)) as url:
        info = httpx.get(f"{url}/info").json()
        assert "images" not in info["capabilities"]
        assert not ServerEngine([url], policy=FAST).accepts_images
        r = httpx.post(f"{url}/generate", json={"prompt_ids": [[3, 4]], "sampling": {"max_tokens": 2},
                                                "images": [[wire_images.to_data_url(image_of(0))]]})
    assert r.status_code == 400 and "does not take images" in r.json()["error"]


@pytest.mark.slow  # ~30-40 s on a quiet machine: a server subprocess and a 3-step run
def test_three_steps_against_a_real_server_sync_the_vision_tower_once(tmp_path):
    from grpo_cli.server.launch import wait_ready_line

    env = clean_env(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    server = subprocess.Popen([sys.executable, "-m", "grpo_cli", "serve-rollout", "--model", "builtin:tiny-vlm",
                               "--port", "0"], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              cwd=tmp_path, env=env)
    lines: list[str] = []
    try:
        url = wait_ready_line(server, 120, lines.append)
        assert url is not None, "".join(lines)[-3000:]
        run = tmp_path / "run"
        sets = ["model.name_or_path=builtin:tiny-vlm", "data.source=builtin:shapes", "train.steps=3",
                "train.prompts_per_step=2", "train.generations_per_prompt=2", "train.micro_batch_size=4",
                "rollout.max_completion_length=4", "eval.every_steps=0", "logging.progress=plain", "rollout.mode=server",
                f'rollout.server.urls=["{url}"]']
        out = subprocess.run([sys.executable, "-m", "grpo_cli", "train", "--output-dir", str(run),
                              *(a for s in sets for a in ("--set", s))], capture_output=True, text=True, timeout=300,
                             env=env, cwd=tmp_path, check=False)
        assert out.returncode == 0, (out.stdout + out.stderr)[-4000:]
    finally:
        server.kill()
        server.wait(10)
    rows = [json.loads(r) for r in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    first, *later = rows  # step 1's sync is the run's first: the whole model; later ones without the vision tower
    vision = later[0]["sync/skipped_tensors"]
    assert "sync/skipped_tensors" not in first and vision > 0
    assert all(r["sync/skipped_tensors"] == vision and r["sync/tensors"] == first["sync/tensors"] - vision
               for r in later)
    assert all(r["sync/max_probe_diff"] <= 1e-4 for r in rows), [r["sync/max_probe_diff"] for r in rows]
    # the sampler's and the trainer's logprobs of image rows agree up to the engine's placeholder ban (docs/vision.md)
    assert all(0 < r["rollout_correction/k3_kl"] < 1e-2 for r in rows), [r["rollout_correction/k3_kl"] for r in rows]
