"""Host memory of a CPU training step (issue 37, at Qwen's 151,936-token vocabulary): ddp on CPU fixes glibc's mmap
threshold at 16 MiB (`backends/cpu_heap.py`) so the decode's (rows × vocabulary) buffers and the chunked head's go
back to the OS when freed, and a training step still runs under it."""

from __future__ import annotations

import torch

from grpo_cli.config.load import build_config
from grpo_cli.rollout.base import RolloutBatch
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.batch import build_batch
from grpo_cli.train.loop import LoopState, Trainer, train_phase
from grpo_cli.train.policy import load_policy


def test_ddp_on_cpu_takes_glibcs_thresholds_and_trains(tiny_checkpoint, monkeypatch):
    import grpo_cli.train.backends.ddp as ddp

    from grpo_cli.train.backends.cpu_heap import VOCAB_THRESHOLD

    tuned = []
    monkeypatch.setattr(ddp, "return_large_frees_to_os", lambda threshold, real=ddp.return_large_frees_to_os:
                        tuned.append((threshold, real(threshold))))
    cfg = build_config("tiny-cpu", overrides=[f"model.name_or_path={tiny_checkpoint}", "train.prompts_per_step=1",
                                              "train.generations_per_prompt=2", "train.micro_batch_size=2",
                                              "train.learning_rate=1e-2"])
    policy = load_policy(cfg, tiny_checkpoint, device=torch.device("cpu"))
    assert tuned == [(VOCAB_THRESHOLD, True)]  # glibc took the thresholds: vocabulary-sized buffers only
    rollout = RolloutBatch(prompt_ids=[[5, 6, 7]], completion_ids=[[8, 9, 10], [11, 12]],
                           finish_reasons=["stop", "stop"])
    batch = build_batch(rollout, group_size=2, pad_token_id=policy.tokenizer.pad_token_id)
    batch.advantages = torch.tensor([1.0, -1.0])
    before = {n: p.detach().clone() for n, p in policy.module.named_parameters()}
    tr = Trainer(cfg=cfg, policy=policy, engine=None, cursor=None, reward_fns=[], dist=DistInfo())
    out = train_phase(tr, LoopState(), batch)
    assert out["grad_norm"] > 0
    assert any(not torch.equal(before[n], p) for n, p in policy.module.named_parameters())  # it stepped
