"""Checkpoints of the megatron backend with `megatron.core.dist_checkpointing`: every rank writes and reads only its
shards of the model chunks and the optimizer (float32 masters, Adam moments), under `mcore/` of the checkpoint."""

from __future__ import annotations

import json
from pathlib import Path

import torch

CKPT_DIR = "mcore"
STEP_FILE = "adam_step.json"
"""Adam's step count, written beside the shards: megatron-core 0.16 restores the moments of torch's Adam but not
its per-parameter `step` (it came back as 0, so the bias correction restarted)."""


def _torch_adams(optimizer) -> list[torch.optim.Optimizer]:
    """The torch Adam(W) instances under Megatron's optimizer (without Transformer Engine / Apex; their fused Adam
    keeps the step in its param groups and needs none of the fixes here)."""
    inner = [part.optimizer for part in getattr(optimizer, "chained_optimizers", [optimizer])]
    return [o for o in inner if isinstance(o, torch.optim.Adam | torch.optim.AdamW)]


def adam_step(optimizer) -> float:
    """The step count of torch's Adam (the same for every parameter; 0 before the first step)."""
    for inner in _torch_adams(optimizer):
        for state in inner.state.values():
            if "step" in state:
                return float(state["step"])
    return 0.0


def _inner(chunk: torch.nn.Module) -> torch.nn.Module:
    """The `GPTModel` (or `Float16Module`) under Megatron's DDP wrapper."""
    return chunk.module if hasattr(chunk, "module") else chunk


def _sharded(chunks: list[torch.nn.Module], optimizer, *, is_loading: bool) -> dict:
    """The sharded state dict of the chunks (`model<i>`, keys global: each chunk knows its layers' offsets) and of
    the optimizer built over them."""
    model = {f"model{i}": _inner(chunk).sharded_state_dict() for i, chunk in enumerate(chunks)}
    flat = {f"{i}.{k}": v for i, part in enumerate(model.values()) for k, v in part.items()}
    # `dp_reshardable`: the distributed optimizer's own shards as they are (the model-space format of
    # megatron-core 0.16 needs flattened ranges its checkpointing no longer supports).
    metadata = {"distrib_optim_sharding_type": "dp_reshardable"}
    return {**model, "optimizer": optimizer.sharded_state_dict(flat, is_loading=is_loading, metadata=metadata)}


def save(folder: Path, chunks: list[torch.nn.Module], optimizer) -> None:
    """Collective: write this rank's shards under `folder/mcore` (created here; rank 0 created `folder`)."""
    from megatron.core import dist_checkpointing

    target = Path(folder) / CKPT_DIR
    if torch.distributed.get_rank() == 0:
        target.mkdir(parents=True, exist_ok=True)
    torch.distributed.barrier()
    dist_checkpointing.save(_sharded(chunks, optimizer, is_loading=False), str(target))
    if torch.distributed.get_rank() == 0:
        (target / STEP_FILE).write_text(json.dumps({"adam_step": adam_step(optimizer)}))
    torch.distributed.barrier()


def _init_adam_state(optimizer) -> None:
    """Give every parameter of a fresh torch Adam its state, `step` included: Megatron's loading template reads
    the step from the state (its own initialiser, written for TE/Apex Adam, adds only the moments)."""
    for inner in _torch_adams(optimizer):
        for group in inner.param_groups:
            for p in group["params"]:
                state = inner.state[p]
                if not state:
                    state["exp_avg"] = torch.zeros_like(p.data)
                    state["exp_avg_sq"] = torch.zeros_like(p.data)
                state.setdefault("step", torch.tensor(0.0))


def load(folder: Path, chunks: list[torch.nn.Module], optimizer) -> None:
    """Collective: read what `save` wrote into the chunks and the optimizer (same parallel layout)."""
    from megatron.core import dist_checkpointing

    _init_adam_state(optimizer)
    state = dist_checkpointing.load(_sharded(chunks, optimizer, is_loading=True), str(Path(folder) / CKPT_DIR))
    for i, chunk in enumerate(chunks):
        _inner(chunk).load_state_dict(state[f"model{i}"])
    with torch.no_grad():  # the masters are copied into in place
        optimizer.load_state_dict(state["optimizer"])
    step = json.loads((Path(folder) / CKPT_DIR / STEP_FILE).read_text())["adam_step"]
    _set_steps(optimizer, step)


def _set_steps(optimizer, step: float) -> None:
    """Every parameter's Adam `step`, each its own tensor (Megatron hands them one shared tensor, which torch's
    Adam would increment once per parameter per step)."""
    for inner in _torch_adams(optimizer):
        for state in inner.state.values():
            state["step"] = torch.tensor(step, dtype=torch.float32)
