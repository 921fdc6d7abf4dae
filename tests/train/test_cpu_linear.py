"""`model.cpu_linear`: the oneDNN linear computes y = x·Wᵀ + b and its gradients as float64 math does (to float32
rounding), leaves autocast (bf16 compute) and small layers to `F.linear`, gives a model the same logprobs and
gradients as PyTorch's matmul (selective checkpointing included), and is installed by the ddp backend on CPU."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from grpo_cli.config.errors import UserError
from grpo_cli.config.load import build_config
from grpo_cli.train.backends import cpu_linear
from grpo_cli.train.backends.cpu_linear import install, use_onednn_linear

pytestmark = pytest.mark.skipif(not cpu_linear.available(), reason="this torch build has no oneDNN linear")


def count_dnnl(monkeypatch) -> list:
    calls = []
    real = cpu_linear._dnnl

    def spy(*args):
        calls.append(args[0].shape)
        return real(*args)

    monkeypatch.setattr(cpu_linear, "_dnnl", spy)
    return calls


def test_forward_and_gradients_equal_float64_math(monkeypatch):
    torch.manual_seed(0)
    layer = nn.Linear(600, 520)
    assert install(nn.Sequential(layer, nn.Linear(128, 700))) == 1  # the 128-input layer stays on MKL
    calls = count_dnnl(monkeypatch)
    x = (torch.randn(3, 70, 600) * 4).requires_grad_()
    y = layer(x)
    gy = torch.randn_like(y)
    y.backward(gy)
    assert len(calls) == 2  # y and ∂x on oneDNN
    x64, w64, b64, gy64 = x.detach().double(), layer.weight.detach().double(), layer.bias.detach().double(), \
        gy.double()
    expected = {
        "y": (y, x64 @ w64.T + b64),
        "dx": (x.grad, gy64 @ w64),
        "dW": (layer.weight.grad, gy64.reshape(-1, 520).T @ x64.reshape(-1, 600)),
        "db": (layer.bias.grad, gy64.sum((0, 1))),
    }
    for name, (got, ref) in expected.items():
        assert got.dtype == torch.float32
        assert (got.double() - ref).abs().max() <= 2e-6 * ref.abs().max(), name


def test_autocast_and_no_grad(monkeypatch):
    layer = nn.Linear(512, 512)
    install(layer)
    calls = count_dnnl(monkeypatch)
    x = torch.randn(4, 512)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert layer(x).dtype == torch.bfloat16  # F.linear under autocast, as without the install
    assert not calls
    with torch.no_grad():
        assert torch.allclose(layer(x), nn.functional.linear(x, layer.weight, layer.bias), atol=1e-5)
    assert len(calls) == 1


@pytest.mark.parametrize("checkpointing", [False, "selective"])
def test_model_logprobs_and_gradients_match_pytorch_matmul(tmp_path, monkeypatch, checkpointing):
    from transformers import AutoModelForCausalLM

    from grpo_cli.models.attention import attention_implementation
    from grpo_cli.models.logprobs import completion_logprobs
    from grpo_cli.train.backends.activations import enable_checkpointing
    from grpo_cli.models.tiny import build_tiny_checkpoint

    path = build_tiny_checkpoint(tmp_path / "q", arch="qwen2", hidden_size=128)
    models = [AutoModelForCausalLM.from_pretrained(path, attn_implementation=attention_implementation("sdpa"))
              for _ in range(2)]
    monkeypatch.setattr(cpu_linear, "MIN_FEATURES", 1)  # the tiny model's layers are below the crossover
    assert install(models[1]) == 15  # 2 layers x 7 projections + lm_head
    ids = torch.randint(5, 60, (6, 24), generator=torch.Generator().manual_seed(1))
    out = []
    for model in models:
        enable_checkpointing(model, checkpointing)
        model.train()
        lp = completion_logprobs(model, ids, torch.ones_like(ids), logits_to_keep=10, temperature=1.0)
        (lp * torch.linspace(-1, 1, lp.numel()).view_as(lp)).sum().backward()
        out.append((lp.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert torch.allclose(out[0][0], out[1][0], atol=1e-5)
    for name, g in out[0][1].items():
        assert (out[1][1][name] - g).abs().max() <= 1e-5 * max(1.0, g.abs().max().item()), name


def test_ddp_backend_installs_it_on_cpu_and_refuses_it_where_it_cannot_run(tiny_checkpoint, monkeypatch):
    from grpo_cli.train.policy import load_policy

    monkeypatch.setattr(cpu_linear, "MIN_FEATURES", 1)
    for setting, expect in [("auto", True), ("onednn", True), ("aten", False)]:
        cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}", f"model.cpu_linear={setting}"])
        policy = load_policy(cfg, tiny_checkpoint, device=torch.device("cpu"))
        layer = policy.module.model.layers[0].mlp.up_proj
        assert (getattr(layer.forward, "__func__", None) is cpu_linear.linear) == expect, setting
    assert not use_onednn_linear("auto", torch.device("meta"), nn.Linear(512, 512))
    monkeypatch.setattr(cpu_linear, "MIN_FEATURES", 512)  # nothing this small to route: onednn would change nothing
    assert not use_onednn_linear("auto", torch.device("cpu"), nn.Linear(128, 128))
    assert use_onednn_linear("auto", torch.device("cpu"), nn.Linear(512, 512))
    with pytest.raises(UserError, match=r"at least 512 input and output features, and this model has none"):
        use_onednn_linear("onednn", torch.device("cpu"), nn.Linear(128, 128))
    with pytest.raises(UserError, match=r"model\.cpu_linear 'onednn' cannot apply: the models train on meta"):
        use_onednn_linear("onednn", torch.device("meta"), nn.Linear(512, 512))


def test_repeated_passes_are_bitwise_equal():
    """Exact resume replays a step on the same shapes: the oneDNN path must give the same bits each time."""
    torch.manual_seed(3)
    layer = nn.Linear(640, 768)
    install(layer)
    x = torch.randn(2, 300, 640)
    results = []
    for _ in range(2):
        layer.zero_grad(set_to_none=True)
        xi = x.clone().requires_grad_()
        y = layer(xi)
        (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
        results.append((y.detach(), xi.grad, layer.weight.grad, layer.bias.grad))
    assert all(torch.equal(a, b) for a, b in zip(*results))
