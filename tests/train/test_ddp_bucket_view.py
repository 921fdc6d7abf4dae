"""ddp wraps the model with `gradient_as_bucket_view=True`: each `.grad` is a view into DistributedDataParallel's
reduce bucket, so a rank holds one copy of the gradients (what `grpo plan` counts), not the gradients plus the
bucket (issue 36). Gradient offload (`distributed.offload.grads`) parks and restores such views and the next step
is the step of a twin that never moved them.

In process on a real 1-rank gloo group: the backend is told it is one of 2 ranks so that it wraps (DDP itself reads
the group, size 1, so the gradients are those of one process)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from grpo_cli.config.load import build_config
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.batch import TrainBatch
from grpo_cli.train.policy import load_policy
from grpo_cli.train.step import optimizer_step
from grpo_cli.train.weights.offload import TrainingStateOffload


@pytest.fixture()
def policies(tiny_checkpoint):
    assert not dist.is_initialized()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        cfg = build_config(overrides=[f"model.name_or_path={tiny_checkpoint}", "distributed.backend=ddp",
                                      "train.prompts_per_step=1", "train.generations_per_prompt=4",
                                      "train.micro_batch_size=2", "train.learning_rate=1e-2"])
        info = DistInfo(rank=0, world_size=2)
        pair = [load_policy(cfg, tiny_checkpoint, device=torch.device("cpu"), info=info) for _ in range(2)]
        yield cfg, pair
    finally:
        dist.destroy_process_group()


def _step(policy, cfg, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(6, policy.module.config.vocab_size, (4, 9), generator=g)
    batch = TrainBatch(ids, torch.ones_like(ids), torch.ones(4, 4), advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
                       sampler_logprobs=-torch.rand(4, 4, generator=g))
    optimizer_step(policy, batch, cfg, num_items=16.0, num_sequences=4)  # 2 micro-batches: no_sync, then sync


def test_gradients_are_views_of_the_reduce_buckets(policies):
    cfg, (policy, _) = policies
    assert isinstance(policy.backend.model, torch.nn.parallel.DistributedDataParallel)
    _step(policy, cfg, 0)
    grads = [p.grad for p in policy.module.parameters() if p.requires_grad]
    storages = {g.untyped_storage().data_ptr() for g in grads}
    assert len(storages) < len(grads), "every gradient has its own storage: a second copy beside DDP's buckets"
    assert all(g._base is not None for g in grads)  # each one a view into its bucket


def test_gradient_offload_round_trips_bucket_views(policies):
    cfg, (policy, twin) = policies
    _step(policy, cfg, 0)
    _step(twin, cfg, 0)
    off = TrainingStateOffload(policy.backend.model, policy.backend.optimizer, optimizer_state=True, grads=True,
                               params=False, force=True)
    before = {n: p.grad.clone() for n, p in policy.module.named_parameters()}
    off.offload()
    assert all(p.grad is None for p in policy.module.parameters())
    off.reload()
    assert all(torch.equal(before[n], p.grad) for n, p in policy.module.named_parameters())
    _step(policy, cfg, 1)
    _step(twin, cfg, 1)
    for (name, p), q in zip(policy.module.named_parameters(), twin.module.parameters(), strict=True):
        assert torch.equal(p, q), name
