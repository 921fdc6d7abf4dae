"""Issue 46's paths on one GPU with torch alone: a VLM on fsdp2 whose micro-batches mix rows with and without
images (the step finishes, the frozen tower is unchanged), a local judge parked in host memory between scoring
calls, and token-budget micro-batches (`train.micro_batch_tokens`) within `grpo plan`'s count."""

from __future__ import annotations

import json
import random

import torch
from gpu_helpers import DEVICE, grpo, hf_server, sets, summary

from grpo_cli.config.load import build_config


def _mixed_rows(tmp_path) -> str:
    """A .jsonl of chat prompts: two with a drawn image, two text-only (a micro-batch of one prompt's group holds
    either kind), each answered by a colour word."""
    from grpo_cli.data.tasks import draw_shapes

    rows = []
    for i, colour in enumerate(("red", "blue")):
        image = tmp_path / f"shape{i}.png"
        draw_shapes(colour, 2, "circle", random.Random(i)).resize((56, 56)).save(image)
        rows.append({"prompt": [{"role": "user", "content": [{"type": "image", "image": str(image)},
                                                             {"type": "text", "text": "what colour are the shapes ?"}]}]})
        rows.append({"prompt": [{"role": "user", "content": [{"type": "text", "text": f"say {colour} ."}]}]})
    path = tmp_path / "mixed.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_vlm_fsdp2_steps_on_micro_batches_with_and_without_images(tmp_path, tiny_vlm):
    """One process: the micro-batches without an image run the tower on a dummy image (weight 0), so fsdp2's
    per-block gathers pair on every rank; the frozen tower stays bit-identical in the exported model."""
    from safetensors.torch import load_file

    config = tmp_path / "vlm.yaml"
    config.write_text(json.dumps({"rewards": {"functions": [
        {"name": "format", "kwargs": {"pattern": "red|green|blue|one|two|three"}}]}}))
    run = tmp_path / "run"
    with hf_server(tmp_path, tiny_vlm) as url:
        grpo(tmp_path, "train", "--config", str(config), "--output-dir", str(run), *sets(
            f"model.name_or_path={tiny_vlm}", f"data.source={_mixed_rows(tmp_path)}", "rollout.engine=hf",
            "rollout.mode=server", f'rollout.server.urls=["{url}"]', "rollout.max_completion_length=2",
            f"distributed.device={DEVICE}", "distributed.backend=fsdp2", "model.dtype=bfloat16", "train.steps=2",
            "train.prompts_per_step=4", "train.generations_per_prompt=2", "train.micro_batch_size=2",
            "eval.every_steps=0"))
    assert summary(run)["steps"] == 2
    before = load_file(f"{tiny_vlm}/model.safetensors")
    after = load_file(str(run / "final-model" / "model.safetensors"))
    vision = [n for n in before if n.startswith("model.visual.")]
    assert vision and all(before[n].to(after[n].dtype).equal(after[n]) for n in vision)


def test_a_parked_local_judge_scores_on_the_gpu_and_waits_on_the_host(tmp_path, tiny_checkpoint):
    """Beside a colocated engine the judge is parked: one scoring call of several `batch_size` chunks moves it to
    the GPU and back once, answers every prompt, and leaves its weights in host memory."""
    from grpo_cli.rewards.resolve import reward_fns_for, score

    prompt = tmp_path / "judge.j2"
    prompt.write_text("Rate: {{ completion }}")
    entry = {"judge": tiny_checkpoint, "prompt": str(prompt), "max_tokens": 2, "device": "auto", "batch_size": 2}
    cfg = build_config(overrides=[f"rewards.functions=[{json.dumps(entry)}]", "rollout.engine=vllm",
                                  "model.dtype=bfloat16", f"distributed.device={DEVICE}"])
    fns = reward_fns_for(cfg, torch.device(DEVICE, 0) if DEVICE == "cuda" else torch.device("cpu"))
    backend = fns[0].fn.backend
    if DEVICE == "cuda":
        assert backend.park  # beside a colocated engine
    table, errors = score(fns, ["q"] * 7, [f"answer {i}" for i in range(7)], {}, on_error="raise")
    assert len(table) == 7 and errors == 0
    assert backend.stats.requests >= 1 and backend.stats.failed_requests == 0
    assert next(backend.model.parameters()).device.type == "cpu"


def test_token_budget_micro_batches_on_the_gpu_stay_within_the_plan(tmp_path, monkeypatch):
    """A step with `train.micro_batch_tokens` runs on the GPU, and every pass cuts at most as many micro-batches as
    `grpo plan`'s `gradient_accumulation` (the plan's worst case: every row of the longest sequence)."""
    from grpo_cli.planner.plan import batch_plan
    from grpo_cli.train import batch as batch_mod
    from grpo_cli.train.run import run_training

    base = [f"distributed.device={DEVICE}", "model.dtype=bfloat16", "train.steps=2", "eval.every_steps=0",
            "train.prompts_per_step=4", "train.generations_per_prompt=4", "train.micro_batch_size=8",
            "rollout.max_completion_length=8", "logging.progress=plain"]
    longest = build_config(overrides=base).max_sequence_length
    cfg = build_config(overrides=[*base, f"train.micro_batch_tokens={2 * longest}"])
    plan = batch_plan(cfg)
    counts: list[int] = []
    real = batch_mod.micro_batch_rows

    def counted(*args, **kwargs):
        groups = real(*args, **kwargs)
        counts.append(len(groups))
        return groups

    monkeypatch.setattr(batch_mod, "micro_batch_rows", counted)
    assert run_training(cfg, output_dir=str(tmp_path / "run"))["steps"] == 2
    assert counts and all(1 <= c <= plan["gradient_accumulation"] for c in counts), (counts, plan)
