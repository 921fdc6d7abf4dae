"""`grpo plan`'s sizing of `train.micro_batch_tokens`: the activation memory of one micro-batch, counted in positions,
and the budgets to pick from (the one that matches `micro_batch_size` rows of the longest sequence, and with
`--gpu-mem` the largest that fits)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.config.model_shape import BYTES, model_shape

if TYPE_CHECKING:
    from collections.abc import Callable

    from grpo_cli.config.model_shape import ModelShape
    from grpo_cli.config.schema import GRPOConfig

GRANULE = 256
"""Suggested budgets are rounded down to a multiple of this many positions."""


def micro_batch_positions(cfg: GRPOConfig) -> int:
    """Positions of the largest micro-batch: the token budget, else `micro_batch_size` rows of the longest
    sequence (rows are padded to it)."""
    return cfg.train.micro_batch_tokens or cfg.train.micro_batch_size * cfg.max_sequence_length


def activation_bytes_per_position(cfg: GRPOConfig, shape: ModelShape) -> float:
    """Activation bytes a position keeps for the backward: hidden × layers × `model.dtype` bytes × a factor for
    what each layer saves (16; 10 with selective, 2 with full gradient checkpointing)."""
    factor = {True: 2, "selective": 10}.get(cfg.model.gradient_checkpointing, 16)
    return shape.hidden * shape.layers * BYTES[cfg.model.dtype] * factor


def token_budget_plan(cfg: GRPOConfig, per_position: float, fits) -> dict[str, str]:
    """Rows of `grpo plan`'s token-budget section. `fits(positions)` says whether the peak with a micro-batch of
    that many positions fits `--gpu-mem` (None without one)."""
    t, longest = cfg.train, cfg.max_sequence_length
    same = t.micro_batch_size * longest
    rows = {
        "micro_batch_tokens": f"{t.micro_batch_tokens}" if t.micro_batch_tokens else
        "off (micro-batches of micro_batch_size rows, counted here padded to the longest sequence)",
        "activations_per_position": f"{per_position / 1024**2:.3f} MiB",
        "activations_per_micro_batch": f"{micro_batch_positions(cfg) * per_position / 1024**3:.2f} GiB "
                                       f"({micro_batch_positions(cfg)} positions at most)",
        "same_memory_as_rows": f"{same} (micro_batch_size {t.micro_batch_size} x longest sequence {longest})",
    }
    if fits is not None:
        if not fits(longest):
            rows["largest_that_fits"] = f"none: one sequence of {longest} positions does not fit"
        else:
            low, high = longest, longest
            while fits(high * 2) and high < 1 << 40:
                low, high = high * 2, high * 2
            high *= 2
            while high - low > 1:  # fits(low), not fits(high)
                mid = (low + high) // 2
                low, high = (mid, high) if fits(mid) else (low, mid)
            rows["largest_that_fits"] = f"{max(longest, low // GRANULE * GRANULE)}"
    return rows


def token_budget_lines(cfg: GRPOConfig, mem: dict[str, float], limit: float | None, *,
                       peak: Callable[[GRPOConfig, dict[str, float]], float]) -> list[str]:
    """`grpo plan`'s token-budget section; `limit` is the usable GPU memory (`--gpu-mem` less the headroom) and
    `peak(cfg, mem)` the plan's peak (`plan.peak_bytes`), evaluated with the activations of each budget tried."""
    # per GPU: the budget is per sequence-parallel group, each rank keeps 1/size of its positions (plan_sequence)
    per = activation_bytes_per_position(cfg, model_shape(cfg.model.name_or_path)) / cfg.distributed.sequence_parallel.size
    fits = None if not limit else (lambda n: peak(cfg, mem | {"activations": n * per}) <= limit)
    rows = token_budget_plan(cfg, per, fits)
    return ["# token budget (train.micro_batch_tokens)"] + [f"  {k:28s} {v}" for k, v in rows.items()]
