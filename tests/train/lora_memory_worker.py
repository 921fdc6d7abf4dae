"""Worker for test_lora_memory: build a policy (`CKPT OVERRIDE...`), run the reference and policy logprob passes
and one optimizer step as the loop does, and print the process's peak RSS in MB as JSON."""

from __future__ import annotations

import json
import resource
import sys

import torch

from grpo_cli.config.load import build_config
from grpo_cli.train.policy import load_policy


def main(ckpt: str, *sets: str) -> None:
    cfg = build_config("tiny-cpu", overrides=[f"model.name_or_path={ckpt}", *sets])
    policy = load_policy(cfg, ckpt, device=torch.device("cpu"))
    ids = torch.randint(6, 60, (8, 48))
    if cfg.algorithm.kl.beta > 0:
        with policy.backend.reference() as ref, torch.no_grad():
            ref(input_ids=ids)
    loss = policy.model(input_ids=ids, labels=ids).loss
    policy.backend.backward(loss)
    policy.backend.clip_and_step()
    print(json.dumps({"peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))


if __name__ == "__main__":
    main(*sys.argv[1:])
