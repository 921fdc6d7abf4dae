"""`rollout.compile`: the hf engine's decode step under torch.compile samples what the eager step samples (Qwen3:
q/k norms, GQA; rows dropped mid-decode; a second batch of another prompt width reuses the compile); a machine
without a C++ compiler and settings where the trainer builds no hf engine get a clear refusal."""

from __future__ import annotations

import pytest
import torch

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import build_config
from grpo_cli.runtime import compiler
from grpo_cli.rollout.hf import decode as decode_mod
from grpo_cli.models.attention import attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.hf.decode import decode, decode_continue

pytestmark = pytest.mark.skipif(compiler.compiler_problem(torch.device("cpu")) is not None,
                                reason="inductor cannot build CPU kernels here")


def load(tmp_path_factory, arch: str, hidden_size: int = 128, num_layers: int = 2):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp(arch) / "ckpt", hidden_size=hidden_size,
                                 num_layers=num_layers, arch=arch)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_implementation("sdpa"))


def test_compiled_decode_step_samples_what_the_eager_step_samples(tmp_path_factory, monkeypatch):
    """The decode step under torch.compile (attention as fused reductions instead of batched matmuls, the draw
    fused in): the same tokens and logprobs to 1e-5, with rows dropped mid-decode; prompts of another width (another
    cache length), other batch sizes and a next turn on the kept KV run on the same compiled graph."""
    from torch._dynamo.utils import counters

    model = load(tmp_path_factory, "qwen3").eval()
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", 0.0)  # drop every finished row at once
    sampling = SamplingParams(n=4, max_tokens=12, temperature=0.9, seed=7)
    graphs, dropped = counters["stats"]["unique_graphs"], []
    for prompts in ([[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]], [[3, 4, 5, 6, 7, 8, 9, 10, 11], [9]]):
        eager = decode(model, prompts, sampling, eos_token_ids=[1], pad_token_id=0, keep=True)
        compiled = decode(model, prompts, sampling, eos_token_ids=[1], pad_token_id=0, compile_step=True, keep=True)
        assert torch.equal(compiled.lengths, eager.lengths) and torch.equal(compiled.tokens, eager.tokens)
        assert torch.allclose(compiled.logprobs, eager.logprobs, atol=1e-5)
        dropped.append(0 < int(eager.stopped.sum()) < len(eager.stopped))
        # a next turn on the kept KV (multi-turn rollouts): rows of other history lengths, the same graph
        new_ids = [[5 + j % 3] * (1 + j % 4) for j in range(len(eager.kept))]
        turn = [decode_continue(model, d.kept, new_ids, sampling, eos_token_ids=[1], pad_token_id=0, compile_step=c)
                for d, c in ((eager, False), (compiled, True))]
        assert torch.equal(turn[0].tokens, turn[1].tokens)
        assert torch.allclose(turn[0].logprobs, turn[1].logprobs, atol=1e-5)
    assert any(dropped)  # some rows stopped (and were dropped) while others ran on
    assert counters["stats"]["unique_graphs"] == graphs + 1  # compiled once, for every batch size and width


def test_compiled_step_keeps_the_onednn_linear_of_routed_layers(tmp_path_factory, monkeypatch):
    """Layers `model.cpu_linear` routes to oneDNN (≥ 512 features) run it inside the compiled step too, as an
    opaque op (inductor cannot lower mkldnn's linear with dynamic shapes), with the eager step's tokens."""
    from grpo_cli.train.backends import cpu_linear

    if not cpu_linear.available():
        pytest.skip("this torch build has no oneDNN linear")
    model = load(tmp_path_factory, "qwen2", hidden_size=512, num_layers=1).eval()
    assert cpu_linear.install(model) > 0
    calls = []
    real = cpu_linear._dnnl
    monkeypatch.setattr(cpu_linear, "_dnnl", lambda *args: calls.append(1) or real(*args))
    prompts, sampling = [[3, 5, 7], [4, 6, 8, 9]], SamplingParams(n=2, max_tokens=6, seed=3)
    eager = decode(model, prompts, sampling, eos_token_ids=[1], pad_token_id=0)
    before = len(calls)
    compiled = decode(model, prompts, sampling, eos_token_ids=[1], pad_token_id=0, compile_step=True)
    assert len(calls) > before  # the compiled graph called oneDNN
    assert torch.equal(compiled.tokens, eager.tokens)
    assert torch.allclose(compiled.logprobs, eager.logprobs, atol=1e-5)


def test_a_step_torch_compile_cannot_build_runs_eagerly(tmp_path_factory, monkeypatch):
    from torch._dynamo.exc import BackendCompilerFailed

    from grpo_cli.rollout.hf import decode_step

    def broken(*args, **kwargs):
        raise BackendCompilerFailed(lambda *a: None, RuntimeError("lowering failed"), None)

    model = load(tmp_path_factory, "qwen2").eval()
    prompts, sampling = [[3, 5, 7], [4, 6, 8, 9]], SamplingParams(n=2, max_tokens=6, seed=3)
    eager = decode(model, prompts, sampling, eos_token_ids=[1], pad_token_id=0)
    monkeypatch.setattr(decode_mod, "compiled_decode_sample", lambda: fallback)
    fallback = decode_step.with_eager_fallback(broken)
    with pytest.warns(RuntimeWarning, match="could not build the decode step .*decodes eagerly"):
        out = decode(model, prompts, sampling, eos_token_ids=[1], pad_token_id=0, compile_step=True)
    assert torch.equal(out.tokens, eager.tokens) and torch.equal(out.logprobs, eager.logprobs)


def test_missing_compiler_is_named(monkeypatch):
    import torch._inductor.cpp_builder as builder

    def missing():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(builder, "get_cpp_compiler", missing)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    problem = compiler.compiler_problem(torch.device("cpu"))
    assert "no C++ compiler" in problem and "/nonexistent/g++" in problem
    with pytest.raises(UserError, match=r"set rollout\.compile=false"):
        compiler.require_compiler(torch.device("cpu"))
    with pytest.raises(UserError, match=r"--compile needs .* drop --compile"):
        compiler.require_compiler(torch.device("cpu"), setting="--compile")


def test_compile_is_refused_for_a_model_that_decodes_through_its_full_forward(tmp_path_factory):
    from grpo_cli.rollout.hf.engine import require_compilable

    require_compilable(load(tmp_path_factory, "qwen2"))
    with pytest.raises(UserError, match=r"rollout\.compile .*GemmaForCausalLM decodes through its full forward"):
        require_compilable(load(tmp_path_factory, "gemma"))
    with pytest.raises(UserError, match=r"drop --compile"):
        require_compilable(load(tmp_path_factory, "gemma"), setting="--compile")


def test_compile_is_refused_where_the_trainer_builds_no_hf_engine():
    with pytest.raises(UserError, match=r"rollout\.compile .*rollout\.engine is 'vllm'"):
        build_config("tiny-cpu", None, ["rollout.compile=true", "rollout.engine=vllm"])
    with pytest.raises(UserError, match=r"rollout\.compile .*--compile there"):
        build_config("tiny-cpu", None, ["rollout.compile=true", "rollout.mode=server",
                                        'rollout.server.urls=["http://x:1"]'])
    assert build_config("tiny-cpu", None, ["rollout.compile=true"]).rollout.compile is True
