"""fsdp2's reach into FSDP2's private per-parameter records works on every torch the package floor admits: torch
2.6-2.11 keep one `FSDPParamGroup` (or None) in `FSDPState._fsdp_param_group`, 2.12+ a list `_fsdp_param_groups`
(the singular became a property that raises when a module has several groups). Issue 36: on torch 2.11 the plural
did not exist and fsdp2 failed to build ("'FSDPState' object has no attribute '_fsdp_param_groups'")."""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard


@pytest.fixture()
def sharded():
    """Two Linear layers and the root, each `fully_shard`ed, on a 1-rank gloo group made and destroyed here. The root
    holds no parameter of its own (its group is None in the old layout, absent from the list in the new one)."""
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
        for layer in (model[0], model[2]):
            fully_shard(layer)
        fully_shard(model)
        yield model
    finally:
        dist.destroy_process_group()


def _old_layout(monkeypatch):
    """Make every `fully_shard`ed module report the torch <= 2.11 state: `_fsdp_param_group`, one group or None."""
    real = FSDPModule._get_fsdp_state

    def old_state(self):
        groups = real(self)._fsdp_param_groups
        return types.SimpleNamespace(_fsdp_param_group=groups[0] if groups else None)

    monkeypatch.setattr(FSDPModule, "_get_fsdp_state", old_state)


@pytest.mark.parametrize("layout", ["list (torch >= 2.12)", "one group (torch <= 2.11)"])
def test_every_parameter_is_found_in_either_layout(sharded, monkeypatch, layout):
    from grpo_cli.train.backends.fsdp2 import _fsdp_params, fsdp_param_groups, gradient_bytes

    if layout.startswith("one"):
        _old_layout(monkeypatch)
    assert len(list(fsdp_param_groups(sharded))) == 2
    found = {id(f.sharded_param) for f in _fsdp_params(sharded)}
    assert found == {id(p) for p in sharded.parameters()}
    sharded(torch.randn(3, 4)).sum().backward()
    assert gradient_bytes(sharded) == sum(p.numel() * 4 for p in sharded.parameters())

