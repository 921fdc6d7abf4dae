"""`model.compile`: compiling the norms and gated MLPs leaves a packed training forward's logprobs and gradients
where the eager model puts them (on Qwen2: q/k/v biases, tied embeddings; and Qwen3: q/k norms) and the module and
parameter names untouched; the compiled decode step samples what the eager step samples; a machine without a C++
compiler and the sharded backends get a clear refusal."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import build_config
from grpo_cli.launch import compiler
from grpo_cli.rollout import decode as decode_mod
from grpo_cli.rollout.attention import attention_implementation
from grpo_cli.rollout.base import SamplingParams
from grpo_cli.rollout.decode import decode
from grpo_cli.rollout.scoring import completion_logprobs
from grpo_cli.train.compile import compile_hot_modules

pytestmark = pytest.mark.skipif(compiler.compiler_problem(torch.device("cpu")) is not None,
                                reason="inductor cannot build CPU kernels here")


def load(tmp_path_factory, arch: str):
    from transformers import AutoModelForCausalLM

    from grpo_cli.train.tiny_model import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path_factory.mktemp(arch) / "ckpt", hidden_size=128, arch=arch)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                attn_implementation=attention_implementation("sdpa"))


def grouped_batch(groups: int, size: int, prompt_width: int, completion: int, seed: int):
    """Left-padded prompts shared by each group of `size` rows, right-padded completions (what packing sees)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.zeros(groups * size, prompt_width + completion, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for p in range(groups):
        length = int(torch.randint(2, prompt_width + 1, (), generator=g))
        prompt = torch.randint(5, 60, (length,), generator=g)
        for r in range(p * size, (p + 1) * size):
            ids[r, prompt_width - length : prompt_width], mask[r, prompt_width - length : prompt_width] = prompt, 1
            n = int(torch.randint(1, completion + 1, (), generator=g))
            ids[r, prompt_width : prompt_width + n] = torch.randint(5, 60, (n,), generator=g)
            mask[r, prompt_width : prompt_width + n] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_compiled_modules_keep_logprobs_gradients_and_names(tmp_path_factory, arch):
    from torch._dynamo.utils import counters

    eager = load(tmp_path_factory, arch)
    compiled = copy.deepcopy(eager)
    graphs = counters["stats"]["unique_graphs"]
    layers = len(eager.model.layers)
    norms_per_layer = 4 if arch == "qwen3" else 2  # input/post-attention norms (+ q/k norms)
    assert compile_hot_modules(compiled, None) == layers * (norms_per_layer + 1) + 1  # + MLPs + the final norm
    assert list(compiled.state_dict()) == list(eager.state_dict())
    for seed in (0, 1):  # two packed token counts: one dynamic-shape compile serves both
        ids, mask = grouped_batch(3, 4, 9, 12, seed)
        out = {}
        for name, model in (("eager", eager), ("compiled", compiled)):
            model.zero_grad(set_to_none=True)
            lp = completion_logprobs(model, ids, mask, logits_to_keep=12, temperature=0.8)
            (lp * torch.linspace(-1, 1, lp.numel()).reshape(lp.shape)).sum().backward()
            out[name] = lp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}
        (lp_e, grads_e), (lp_c, grads_c) = out["eager"], out["compiled"]
        assert (lp_e - lp_c).abs().max() <= 1e-5
        assert lp_e.abs().sum() > 0
        for name, grad in grads_e.items():
            assert (grad - grads_c[name]).abs().max() <= 1e-5 * grad.abs().max() + 1e-9, name
    assert counters["stats"]["unique_graphs"] > graphs  # the modules did run compiled


def test_compiled_decode_step_samples_what_the_eager_step_samples(tmp_path_factory, monkeypatch):
    """The decode step under torch.compile (attention as fused reductions instead of batched matmuls): the same
    tokens and logprobs to 1e-5, with rows dropped mid-decode (a second, dynamic-batch compile)."""
    from torch._dynamo.utils import counters

    model = load(tmp_path_factory, "qwen3").eval()
    monkeypatch.setattr(decode_mod, "COMPACT_FRACTION", 0.0)  # drop every finished row at once
    prompts = [[3, 5, 7, 9, 11], [4, 6], [8, 9, 10, 11, 12, 13, 14], [20]]
    sampling = SamplingParams(n=4, max_tokens=12, temperature=0.9, seed=7)
    eager = decode(model, prompts, sampling, eos_token_ids=[1], pad_token_id=0)
    graphs = counters["stats"]["unique_graphs"]
    compiled = decode(model, prompts, sampling, eos_token_ids=[1], pad_token_id=0, compile_step=True)
    assert counters["stats"]["unique_graphs"] > graphs
    assert 0 < int(eager.stopped.sum()) < len(eager.stopped)
    assert torch.equal(compiled.lengths, eager.lengths) and torch.equal(compiled.tokens, eager.tokens)
    assert torch.allclose(compiled.logprobs, eager.logprobs, atol=1e-5)


def test_missing_compiler_is_named(monkeypatch):
    import torch._inductor.cpp_builder as builder

    def missing():
        raise RuntimeError("no compiler")

    monkeypatch.setattr(builder, "get_cpp_compiler", missing)
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    problem = compiler.compiler_problem(torch.device("cpu"))
    assert "no C++ compiler" in problem and "/nonexistent/g++" in problem
    with pytest.raises(UserError, match=r"model\.compile=false"):
        compiler.require_compiler(torch.device("cpu"))


def test_sharded_backends_refuse_compile():
    overrides = ["model.compile=true", "distributed.backend=fsdp2", "rollout.mode=server",
                 'rollout.server.urls=["http://x:1"]']
    with pytest.raises(UserError, match=r"model\.compile .*'ddp' only \(not 'fsdp2'"):
        build_config("tiny-cpu", None, overrides)
    assert build_config("tiny-cpu", None, ["model.compile=true"]).model.compile is True
