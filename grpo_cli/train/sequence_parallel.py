"""`distributed.sequence_parallel`: the world is data parallel × `size`; groups of `size` consecutive ranks share
each micro-batch (cut by positions, `models.sequence_logprobs`). Each rank still generates and scores its own
prompts; the group's ranks then train on the union of their batches (`gather_batch`)."""

from __future__ import annotations

import torch

from grpo_cli.config.errors import UserError
from grpo_cli.config.schema import GRPOConfig
from grpo_cli.models.sequence_attention import SequenceShard
from grpo_cli.runtime.dist import DistInfo
from grpo_cli.train.batch import TrainBatch


def make_shard(cfg: GRPOConfig, info: DistInfo) -> SequenceShard | None:
    """This rank's sequence-parallel group (None at size 1). Collective: every rank creates every group, in order."""
    sp = cfg.distributed.sequence_parallel
    if sp.size == 1:
        return None
    if info.world_size % sp.size:
        raise UserError(f"distributed.sequence_parallel.size={sp.size} does not divide the {info.world_size} "
                        "training processes; pick a size that divides distributed.num_processes × num_machines.")
    import torch.distributed as dist

    mine = None
    for first in range(0, info.world_size, sp.size):
        ranks = list(range(first, first + sp.size))
        group = dist.new_group(ranks)
        if info.rank in ranks:
            mine = SequenceShard(group, sp.size, info.rank - first, sp.style, tuple(ranks))
    return mine


def check_model(module: torch.nn.Module, shard: SequenceShard | None) -> None:
    """Refuse (naming the field and the fix) a model whose forward the shards cannot reproduce exactly."""
    if shard is None:
        return
    from grpo_cli.models.attention import NAME
    from grpo_cli.models.logprobs import LOGIT_TRANSFORMS, _packable

    config = getattr(module, "module", module).config.get_text_config(decoder=True)
    field = "distributed.sequence_parallel.size"
    if config._attn_implementation != NAME or _packable(module) is None:
        raise UserError(f"{field}={shard.size}: the model's attention ({config._attn_implementation}, sliding "
                        "window or layer types) cannot run on packed rows, which sequence parallelism cuts; it needs "
                        "model.attn_implementation=sdpa and full attention in every layer. Set the size to 1.")
    if any(getattr(config, name, None) not in (None, 1, 1.0) for name in LOGIT_TRANSFORMS):
        raise UserError(f"{field}={shard.size}: this model transforms its logits after the output layer (a soft cap "
                        "or scale), which the sharded output layer does not reproduce; set the size to 1.")
    heads = config.num_attention_heads
    if shard.style == "ulysses" and heads % shard.size:
        raise UserError(f"{field}={shard.size} with style 'ulysses' splits the {heads} attention heads over the "
                        f"group, which needs the size to divide them; pick a size among "
                        f"{[d for d in range(2, heads + 1) if heads % d == 0]} or set "
                        "distributed.sequence_parallel.style=ring.")


def _widen(part: TrainBatch, prompt_len: int, steps: int, pad_token_id: int) -> dict[str, torch.Tensor]:
    """`part`'s tensors with the prompt left-padded to `prompt_len` columns and the completion right-padded to
    `steps` (ids with `pad_token_id`, everything else with 0)."""
    own_steps = part.num_completion_tokens
    left = prompt_len - (part.input_ids.shape[1] - own_steps)
    out = {}
    for name, v in part._tensors().items():
        if name in ("input_ids", "attention_mask"):
            fill = pad_token_id if name == "input_ids" else 0
            v = torch.nn.functional.pad(v, (left, steps - own_steps), value=fill)
        elif v.dim() == 2 and v.shape[1] == own_steps:
            v = torch.nn.functional.pad(v, (0, steps - own_steps))
        out[name] = v
    return out


def gather_batch(batch: TrainBatch, shard: SequenceShard | None, *, pad_token_id: int) -> TrainBatch:
    """The group's batch: every rank's rows in rank order (collective over the group), widened to the longest prompt
    and completion; `batch` itself without sequence parallelism."""
    if shard is None:
        return batch
    if batch.vision is not None:
        raise UserError("distributed.sequence_parallel cannot shard image rows; set its size to 1.")
    import torch.distributed as dist

    parts: list = [None] * shard.size
    dist.all_gather_object(parts, batch.to(torch.device("cpu")), group=shard.group)
    prompt_len = max(p.input_ids.shape[1] - p.num_completion_tokens for p in parts)
    steps = max(p.num_completion_tokens for p in parts)
    wide = [_widen(p, prompt_len, steps, pad_token_id) for p in parts]
    names = [n for n in wide[0] if all(n in w for w in wide)]
    if any(set(w) != set(names) for w in wide):
        raise RuntimeError("the sequence-parallel group's batches carry different fields")
    joined = {name: torch.cat([w[name] for w in wide]) for name in names}
    return TrainBatch(**joined)


def data_parallel_size(info: DistInfo, shard: SequenceShard | None) -> int:
    """Ranks that train different rows: the world divided by the sequence-parallel size."""
    return info.world_size // (1 if shard is None else shard.size)
