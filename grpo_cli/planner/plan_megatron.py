"""`grpo plan`'s rows for the megatron backend: its process grid, the training state per GPU and the activations
of one step, from the config alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

from grpo_cli.algo.chunk_size import chunk_bytes
from grpo_cli.config.model_shape import BYTES, QWEN_VOCAB, ModelShape
from grpo_cli.config.rules_megatron import megatron_layout

if TYPE_CHECKING:
    from grpo_cli.config.schema import GRPOConfig

def megatron_state_bytes(cfg: GRPOConfig, shape: ModelShape) -> dict[str, float]:
    """Per-GPU bytes of the megatron backend's training state. P = parameters, X = routed-expert parameters
    (`shape.expert_params`, 0 when dense), D = P − X; c = bytes of `model.dtype`; grid from `megatron_layout`:

        weights    = c · (D / (tp·pp) + X / (ep·etp·pp))
        gradients  = 4 · (D / (tp·pp) + X / (ep·etp·pp))           Megatron DDP's float32 grad buffers
        optimizer  = o · (D / (tp·pp·dp') + X / (ep·etp·pp·edp'))   o = 12 (fp32 master + 2 Adam moments), 8 when
                                                                    model.dtype is float32 (no separate master)
        dp' = dp·cp and edp' = edp with `distributed_optimizer` (ZeRO-1 over the data-parallel ranks, context
        parallel ranks included), else 1.

    The same count as Megatron-LM's `compute_weight_and_optimizer_memory` (6 + 12/dp bytes per parameter on the
    most loaded shard, 6 + 12/edp for expert parameters) with bf16 weights. Approximated: the embedding and the
    output head sit on the first and last pipeline stages only, but are spread evenly over the pp stages here (the
    most loaded stage holds more by up to vocab·hidden·c/tp); the vocabulary padding to a multiple of tp, the
    replicated norms and router (split by tp·pp here) and Megatron's bucket padding are ignored."""
    lay, compute = megatron_layout(cfg), BYTES[cfg.model.dtype]
    dense, experts = shape.params - shape.expert_params, shape.expert_params
    held = dense / (lay["tp"] * lay["pp"]) + experts / (lay["ep"] * lay["etp"] * lay["pp"])
    shard = cfg.distributed.megatron.distributed_optimizer
    dp, edp = (max(1, lay["dp"] * lay["cp"]), max(1, lay["edp"])) if shard else (1, 1)
    opt = (8 + (4 if compute != 4 else 0)) * (dense / (lay["tp"] * lay["pp"] * dp)
                                              + experts / (lay["ep"] * lay["etp"] * lay["pp"] * edp))
    return {"weights": held * compute, "gradients": held * 4, "optimizer": opt}


def megatron_activation_bytes(cfg: GRPOConfig, shape: ModelShape, plan: dict[str, int], *, device: str) -> float:
    """Per-GPU activation bytes of one training step on the megatron backend, after Korthikanti et al. 2022
    ("Reducing Activation Recomputation in Large Transformer Models"), for 16-bit activations (×2 in float32);
    `plan` is `grpo plan`'s batch plan (`plan.batch_plan`), `device` the device type the plan's ranks compute on.
    s = max sequence length, b = micro batch, h = hidden, a = heads, L = layers, t = tp, p = pp:

        one layer, one micro-batch:  s·b·h · (10 + 24/t + 5·a·s/(h·t))   no sequence parallel
                                     s·b·h · (34/t + 5·a·s/(h·t))         sequence_parallel
        recompute selective:         the 5·a·s/(h·t) term (the s² attention scores of the pure-torch attention the
                                     backend builds, no Transformer Engine) is recomputed, not stored
        recompute full:              2·s·b·h per layer (÷t with sequence_parallel) + one layer's activations
        in flight:                   L/p layers × min(p, micro-batches per step) micro-batches (1F1B: the first stage
                                     holds p micro-batches before its first backward)
        + logits:                    one chunk of the chunked head (`algo.chunk_size.chunk_bytes`): min(s·b, rows)
                                     positions × vocab/t × 4 bytes × CHUNK_BUFFERS, rows = 2^28 // (vocab/t) on CUDA,
                                     2^24 // (vocab/t) on the CPU (the head projects a chunk of positions at a time;
                                     the (s·b, vocab/t) logits are never whole)

    Approximated: a MoE layer's expert MLPs (top-k tokens through k small experts) are counted like a dense MLP;
    the interleaved schedule's extra (1 + (p−1)/(p·virtual_pipeline)) on the first stage is left out."""
    m = cfg.distributed.megatron
    s, b, h, t, p = plan["max_sequence_length"], cfg.train.micro_batch_size, shape.hidden, m.tensor_parallel, \
        m.pipeline_parallel
    a = shape.heads or max(1, h // 128)
    sbh, scores = s * b * h, 5 * a * s / (h * t)
    base = 34 / t if m.sequence_parallel else 10 + 24 / t
    per_layer = sbh * (base + (0.0 if m.recompute != "none" else scores))
    layers, in_flight = shape.layers / p, min(p, max(1, plan["gradient_accumulation"]))
    if m.recompute == "full":
        stored = layers * in_flight * 2 * sbh / (t if m.sequence_parallel else 1) + sbh * (base + scores)
    else:
        stored = layers * in_flight * per_layer
    scale = BYTES[cfg.model.dtype] / 2
    shard = -(-(shape.vocab or QWEN_VOCAB) // t)
    return stored * scale + chunk_bytes(shard, s * b, device=device)
