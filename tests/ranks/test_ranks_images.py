"""Images on one rank only (issue 46, item 1): rank 0's rows carry images, rank 1's are text only. The ranks agree
per micro-batch that one has an image, and rank 1 runs the vision tower on a dummy image with zero weight, so
fsdp2's per-block gathers, ZeRO-3's per-module fetches and ddp's reducer (tower trained) pair up. One launch of 2
gloo processes (`images_worker.py`), a 1-minute group timeout: before the fix fsdp2 and ZeRO-3 failed at once
with gloo's "Received data size doesn't match expected size", ddp timed out; and ddp with the tower trained and no
image on any rank failed at the next step ("Expected to have finished reduction in the prior iteration")."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dist_env import run_two_ranks

WORKER = str(Path(__file__).with_name("images_worker.py"))


def _close(a, b, tol: float) -> bool:
    return torch.allclose(torch.tensor(a), torch.tensor(b), atol=tol, rtol=tol)


def test_images_on_one_rank_only_pair_up_and_the_dummy_changes_nothing(tmp_path):
    ranks = run_two_ranks(WORKER, [], tmp_path, timeout=240)
    assert [r["has_vision"] for r in ranks] == [True, False]
    for backend, frozen in (("fsdp2", True), ("zero3", True), ("ddp", False)):
        one = ranks[0]["frozen"] if frozen else ranks[1]["trained"]  # one process, both ranks' rows, no dummy
        for rank, r in enumerate(ranks):
            run = r[backend]
            # the no-grad passes and each micro-batch's loss are those of the same rows on one process
            mine = slice(4 * rank, 4 * rank + 4)
            assert _close(run["old"], one["old"][mine], 1e-5), (backend, rank)
            assert _close(run["ref"], one["ref"][mine], 1e-5), (backend, rank)
            assert _close(run["losses"], one["losses"][2 * rank : 2 * rank + 2], 1e-5), (backend, rank)
            assert abs(run["grad_norm"] - one["grad_norm"]) <= 1e-5 * one["grad_norm"], (backend, rank)
            # the update (every weight, gathered) is the one-process update: the dummy adds no gradient
            for name, moved in one["moved"].items():
                assert _close(run["moved"][name], moved, 1e-5), (backend, rank, name)
        vision = [n for n in one["moved"] if n.startswith("model.visual.")]
        assert all(torch.tensor(ranks[0][backend]["moved"][n]).abs().max() == 0 for n in vision) == frozen, backend
        assert (ranks[0][backend]["trainable_vision"] == 0) == frozen
    # ddp, tower trained, no image on any rank: the reducer got the tower's (zero) gradients, the next step ran
    assert ranks[0]["ddp"]["text_norms"] == ranks[1]["ddp"]["text_norms"] and len(ranks[0]["ddp"]["text_norms"]) == 2


@pytest.mark.parametrize("packed", [False, True])
def test_the_dummy_image_runs_every_tower_parameter_and_changes_nothing(any_vlm, packed):
    """On one process, either architecture (Qwen2.5-VL: window attention): rows without images with the dummy
    (`VisionInputs.dummy_only`) give bit-identical logprobs and entropy, and the backward gives every vision-tower
    parameter a gradient of exactly 0 and every other parameter the gradient it gets without the dummy."""
    from transformers import AutoModelForImageTextToText

    from grpo_cli.models.logprobs import completion_logprobs_entropy
    from grpo_cli.models.vision import VisionInputs, is_vision_parameter

    model = AutoModelForImageTextToText.from_pretrained(any_vlm, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 40, (4, 9), generator=g)
    if packed:  # two groups of two completions sharing a prompt: the packed forward
        ids[1, :5], ids[3, :5] = ids[0, :5], ids[2, :5]
    mask = torch.ones_like(ids)
    mask[1, -1] = 0

    def run(vision):
        model.zero_grad(set_to_none=True)
        lp, ent = completion_logprobs_entropy(model, ids, mask, logits_to_keep=4, temperature=0.7, entropy_grad=True,
                                              vision=vision)
        (lp.sum() + ent.sum()).backward()
        return lp.detach(), ent.detach(), {n: p.grad for n, p in model.named_parameters()}

    lp, ent, grads = run(None)
    lp_d, ent_d, grads_d = run(VisionInputs.dummy_only(4))
    assert torch.equal(lp, lp_d) and torch.equal(ent, ent_d)
    tower = [n for n in grads if is_vision_parameter(n)]
    assert tower and all(grads[n] is None and torch.equal(grads_d[n], torch.zeros_like(grads_d[n])) for n in tower)
    assert all(torch.equal(grads[n], grads_d[n]) for n in grads if n not in tower)
