"""The trainer's AdamW runs fused when the parameters allow it, and the fused update equals the default one."""

from __future__ import annotations

import torch

from grpo_cli.train.backends.base import fused_adam_ok


def test_fused_only_for_plain_float_params_on_one_device():
    assert fused_adam_ok([torch.zeros(3), torch.zeros(2, dtype=torch.bfloat16)])
    assert not fused_adam_ok([torch.zeros(3, device="meta")])
    assert not fused_adam_ok([torch.zeros(3, dtype=torch.int64)])
    assert not fused_adam_ok([])


def test_fused_update_equals_the_default_loop():
    torch.manual_seed(0)
    a = [torch.nn.Parameter(torch.randn(17, 9)), torch.nn.Parameter(torch.randn(9))]
    b = [torch.nn.Parameter(p.detach().clone()) for p in a]
    opts = [torch.optim.AdamW(a, lr=1e-2, weight_decay=0.1),
            torch.optim.AdamW(b, lr=1e-2, weight_decay=0.1, fused=fused_adam_ok(b))]
    for _ in range(10):
        for pa, pb in zip(a, b, strict=True):
            pa.grad = torch.randn_like(pa)
            pb.grad = pa.grad.clone()
        for opt in opts:
            opt.step()
    assert opts[1].param_groups[0]["fused"]
    for pa, pb in zip(a, b, strict=True):
        assert torch.allclose(pa, pb, atol=1e-6)
